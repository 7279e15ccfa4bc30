"""Chapter 0, why parallelism: memory.

- ``calc``: the memory calculator (states, activations per layer: the book's one formula);
- ``tally``: bytes of real tensors (parameters, gradients, optimizer states, saved activations);
- ``checkpointing``: activation checkpointing, the chapter's lesson (recompute in backward);
- ``checks``: the your-turn checks; ``bench``: ``python -m labsupport.bench memory``.

This package re-exports the lesson (the names the chapter defines).
"""
from labsupport.memory.checkpointing import CALLS, attention, attention_core, forward, layer

__all__ = ["CALLS", "attention", "attention_core", "forward", "layer"]
