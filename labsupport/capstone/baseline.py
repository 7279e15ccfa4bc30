"""The one-process baseline, timed: the plain decoder's step, and what composing adds.

    tps = baseline.plain_tokens_per_s(5, threads=1, batch=16)   # on a rank, or here
    r = baseline.one_rank_overhead(steps=5, repeats=3)           # from the notebook
    r["ratio"]       # the 1 x 1 x 1 x 1 trainer's step / models.GPT's step

The baseline every layout is measured against is ``trainer.reference``'s
training: ``models.GPT`` itself, one process, no lesson code and no
communication, timed as ``trainer.train`` times itself (``run_steps``: the
steps after a warm-up, between barriers). Two checks keep it fair:

- the composed trainer at 1 x 1 x 1 x 1 should cost what the plain model
  costs (``one_rank_overhead``): the two run in the same one-rank process,
  on the same threads, taking turns (``timing.alternated``, medians); what
  is left is the composition's own machinery at pp = tp = dp = cp = 1 (the
  pipeline schedule's bookkeeping, the timeline's spans, the loader's slice);
- one process on all the cores against one thread (``plain_tokens_per_s``'s
  ``threads``): ranks that share a machine's cores split its threads, so
  a layout of n ranks is n processes of cores/n threads each.
"""
import contextlib

import torch

from labsupport import timing
from labsupport.capstone import trainer
from labsupport.launch import session

ONE_RANK = (1, 1, 1, 1)


@contextlib.contextmanager
def _threads(threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def plain_tokens_per_s(steps, config=None, *, threads=None, warmup=1, **fields) -> float:
    """tokens/s of one process training ``models.GPT`` itself (``trainer.reference``
    with ``config`` and ``fields``), timed over the steps after ``warmup``, on
    ``threads`` torch threads (default: as they are here)."""
    with _threads(threads):
        return trainer.reference(steps, config, timed=True, warmup=warmup,
                                 **fields)["tokens_per_s"]


def _trainer_tokens_per_s(steps, config=None, *, warmup=1, **fields) -> float:
    return trainer.train(ONE_RANK, steps, config, warmup=warmup, **fields)["tokens_per_s"]


def one_rank_overhead(steps=6, repeats=3, config=None, **fields) -> dict:
    """The 1 x 1 x 1 x 1 ``trainer.train`` step over the one-process ``models.GPT``
    step, from here: both on one rank (``ls.run``, the same process and threads),
    in turn ``repeats`` times each, medians. Returns ``ratio`` (above 1: the
    composition costs more), ``trainer_tokens_per_s``, ``plain_tokens_per_s``,
    ``runs``, and ``threads``, the rank's torch threads."""
    def on_rank(fn):
        return lambda: session.run(fn, steps, config, world_size=1, **fields)[0]

    r = timing.alternated({"trainer": on_rank(_trainer_tokens_per_s),
                           "plain": on_rank(plain_tokens_per_s)}, repeats)
    threads = session.run(torch.get_num_threads, world_size=1)[0]
    return dict(ratio=r["plain"] / r["trainer"], trainer_tokens_per_s=r["trainer"],
                plain_tokens_per_s=r["plain"], runs=r["runs"], threads=threads)
