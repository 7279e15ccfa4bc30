"""Chapter 6, context parallelism.

- ``ring_attention``: the lesson (ring attention with online softmax, forward and backward;
  Ulysses);
- ``crossing``: a ring step's attention beside its k/v transfer, and overlap's speed-up;
- ``checks``: the your-turn checks; ``bench``: ``python -m labsupport.bench ring_attention``.

This package re-exports the lesson (the names the chapter defines).
"""
from labsupport.context_parallel.ring_attention import (
    SCORES,
    HeadsToSeq,
    RingAttention,
    SeqToHeads,
    block_attention,
    block_grads,
    block_mask,
    heads_to_seq,
    lse_merge,
    record_since,
    ring_backward,
    ring_exchange,
    ring_forward,
    seq_to_heads,
    timed,
    ulysses_attention,
)

__all__ = ["SCORES", "HeadsToSeq", "RingAttention", "SeqToHeads", "block_attention",
           "block_grads", "block_mask", "heads_to_seq", "lse_merge", "record_since",
           "ring_backward", "ring_exchange", "ring_forward", "seq_to_heads", "timed",
           "ulysses_attention"]
