"""Chapter 6, context parallelism.

- ``ring_attention``: the lesson (ring attention with online softmax, forward and backward; Ulysses);
- ``crossing``: a ring step's attention beside its k/v transfer, and overlap's speed-up;
- ``checks``: the your-turn checks; ``bench``: ``python -m labsupport.bench ring_attention``.

This package re-exports the lesson (the names the chapter defines).
"""
from labsupport.context_parallel.ring_attention import (SCORES, block_attention,
                                                        lse_merge, block_mask,
                                                        ring_exchange, timed,
                                                        record_since, ring_forward,
                                                        block_grads, ring_backward,
                                                        RingAttention, seq_to_heads,
                                                        heads_to_seq, SeqToHeads,
                                                        HeadsToSeq, ulysses_attention)
