"""Chapter 5, pipeline parallelism.

- ``pipeline``: the lesson (naive, GPipe, 1F1B and interleaved schedules on send/recv);
- ``sim``: ideal schedules in units of time, and their bubbles;
- ``explorer``: the interactive schedule explorer (plotly + ipywidgets);
- ``bubbles``: bubbles measured from a recorded timeline;
- ``zero_bubble``: assignment 3's harness (F, B, W on this chapter's messages);
- ``crossing``: a stage's forward beside sending its activation on;
- ``checks``: the your-turn checks; ``bench``: ``python -m labsupport.bench pipeline``.

This package re-exports the lesson (the names the chapter defines).
"""
from labsupport.pipeline.pipeline import (
    PipelineRank,
    backward_step,
    forward_step,
    post_ready,
    recv,
    run_step,
    run_step_torch,
    send,
    train_step_1f1b,
    train_step_afab,
    train_step_interleaved,
    train_step_naive,
    wait_for,
)

__all__ = ["PipelineRank", "backward_step", "forward_step", "post_ready", "recv", "run_step",
           "run_step_torch", "send", "train_step_1f1b", "train_step_afab",
           "train_step_interleaved", "train_step_naive", "wait_for"]
