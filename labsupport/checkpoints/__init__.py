"""Chapter 10, checkpoints, failures, more than one machine.

- ``sharded_checkpoint``: the lesson (per-rank shards, metadata, atomic rename, load by offsets);
- ``resumable``: the whole training state, resumed exactly
  (``python -m labsupport.checkpoints.resumable``);
- ``elastic``: two torchrun agents on loopback as a two-node job;
- ``checks``: the your-turn checks; ``bench``: ``python -m labsupport.bench checkpoint``.

This package re-exports the sharded checkpoint's lesson (``resumable`` is not
imported here: it runs as ``python -m`` and must not be imported before it).
"""
from labsupport.checkpoints.sharded_checkpoint import (
    METADATA,
    latest_checkpoint,
    load_resharded,
    read_metadata,
    save_sharded,
    write_metadata,
    write_pieces,
    zero3_pieces,
    zero3_restore,
    zero3_wanted,
)

__all__ = ["METADATA", "latest_checkpoint", "load_resharded", "read_metadata", "save_sharded",
           "write_metadata", "write_pieces", "zero3_pieces", "zero3_restore", "zero3_wanted"]
