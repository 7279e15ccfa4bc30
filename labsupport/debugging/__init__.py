"""Chapter 12, debugging distributed runs: find the rank, the call and the line.

- ``zoo``: the fault zoo, each fault a cited real report, runnable on 2-4 gloo
  ranks (the faults of composition on the capstone's trainer, injected through
  its documented options);
- ``gather``: a run's artefacts (Flight Recorder records, messages, collective
  timings, phase times, replica checksums) in one plain dict, the check that a
  fault's tool named it, and torch's analyzer ``torchfrtrace`` run on the dumps;
- ``straggler``: the lesson, the late rank read from time inside collectives;
- ``checks``: the your-turn checks of notebooks/12_debugging_distributed_runs.ipynb;
- ``bench``: ``python -m labsupport.bench debug``.

The launcher's part (every hang's report names where the ranks' Flight Recorder
records part) lives in the base layer: ``labsupport.launch.flight``.
"""
from labsupport.debugging.straggler import late_rank, waits

__all__ = ["late_rank", "waits"]
