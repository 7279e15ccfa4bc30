"""Replace torch.distributed functions, wherever callers find them: for a block, or for good.

A function such as ``all_reduce`` is reached as ``dist.all_reduce`` and as
``torch.distributed.distributed_c10d.all_reduce`` (which torch's own helpers
use); both names are replaced. ``patched`` restores each to what it was
before, so blocks nest (a byte count inside a call log, say); ``install``
replaces for the life of the process (a rank's ``LABSUPPORT_P2P=strict``
mode, ``labsupport.launch.strict_p2p``), under every later block.
"""
import contextlib

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

_MODULES = (c10d, dist)


def current(name: str):
    """The function that callers of ``dist.<name>`` get right now."""
    return getattr(c10d, name)


def install(replacements: dict):
    """``{name: function}`` installed in torch.distributed until replaced again."""
    for module in _MODULES:
        for name, function in replacements.items():
            setattr(module, name, function)


@contextlib.contextmanager
def patched(replacements: dict):
    """``{name: function}`` installed in torch.distributed during the block."""
    saved = [(module, name, getattr(module, name))
             for module in _MODULES for name in replacements]
    try:
        install(replacements)
        yield
    finally:
        for module, name, original in saved:
            setattr(module, name, original)
