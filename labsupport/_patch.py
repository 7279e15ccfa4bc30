"""Replace torch.distributed functions for the length of a block, wherever callers find them.

A function such as ``all_reduce`` is reached as ``dist.all_reduce`` and as
``torch.distributed.distributed_c10d.all_reduce`` (which torch's own helpers
use); both names are replaced, and each is restored to what it was before, so
blocks nest (a byte count inside a call log, say).
"""
import contextlib

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

_MODULES = (c10d, dist)


def current(name: str):
    """The function that callers of ``dist.<name>`` get right now."""
    return getattr(c10d, name)


@contextlib.contextmanager
def patched(replacements: dict):
    """``{name: function}`` installed in torch.distributed during the block."""
    saved = [(module, name, getattr(module, name))
             for module in _MODULES for name in replacements]
    try:
        for module, name, _ in saved:
            setattr(module, name, replacements[name])
        yield
    finally:
        for module, name, original in saved:
            setattr(module, name, original)
