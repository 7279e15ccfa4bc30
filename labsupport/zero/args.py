"""What chapter 7's flat buffers and ``Zero3``'s units accept: their arguments checked.

``check_params`` (for ``FlatParams`` and ``ShardedOptimizer``) and
``unit_params`` (for ``Zero3``) raise a ValueError that says what was wrong
and what to do, before anything is sharded. Plumbing of ``labsupport.zero.zero``,
kept out of the lesson the chapter shows.
"""
import torch
import torch.distributed as dist
from torch import nn


def check_params(params, what="ZeRO", frozen=False) -> list:
    """The distinct parameters of ``params``; ValueError for what a flat buffer cannot
    hold (``frozen``: parameters that do not require grad are let through)."""
    if isinstance(params, torch.Tensor):
        params = [params]
    params = list(dict.fromkeys(params))  # a tied weight once
    if not params:
        raise ValueError(f"{what} got no parameters: pass model.parameters() of a model "
                         "that has some")
    if not dist.is_initialized():
        raise ValueError(f"{what} shards over the ranks of a process group: run it on the "
                         "ranks (ls.run(fn, world_size=N)), after init_process_group")
    for i, p in enumerate(params):
        problem = (not isinstance(p, torch.Tensor) and f"is a {type(p).__name__}, not a tensor"
                   or type(p) not in (torch.Tensor, nn.Parameter) and
                   f"is a {type(p).__name__} (a DTensor or a tensor subclass)"
                   or p.is_sparse and "is sparse" or not (p.requires_grad or frozen) and
                   "is frozen (requires_grad=False): a flat shard is stepped whole, so it "
                   "holds trainable parameters only (ShardedOptimizer leaves frozen ones "
                   "out; for Zero3, unfreeze it or keep it outside the wrapped module)"
                   or not p.is_floating_point() and f"has dtype {p.dtype}"
                   or (p.dtype, p.device) != (params[0].dtype, params[0].device) and
                   f"has dtype {p.dtype} on {p.device}, parameter 0 {params[0].dtype} on "
                   f"{params[0].device}: one flat buffer holds one dtype on one device")
        if problem:
            raise ValueError(f"{what}: parameter {i} (shape {tuple(p.shape)}) {problem}")
    return params


def unit_params(module, units, unit) -> list:
    """The parameters of ``unit`` (None: those of ``module`` in no unit), for Zero3.

    ValueError when a unit is not a submodule of ``module``, when two units
    share a parameter (a tied weight belongs to one unit: put both users in
    the root, or in one unit), or when no parameter is left for the root.
    """
    subs = {id(m) for m in module.modules()}
    owner = {}
    for u in units[:-1]:
        if not isinstance(u, nn.Module) or id(u) not in subs or u is module:
            raise ValueError(f"Zero3: every unit must be a submodule of the wrapped module "
                             f"(not the module itself); got {type(u).__name__}")
        if not list(u.parameters()):
            raise ValueError(f"Zero3: the unit {type(u).__name__} has no parameters: list "
                             "only modules that have some")
        for p in u.parameters():
            if owner.setdefault(p, u) is not u:
                raise ValueError(f"Zero3: a parameter of shape {tuple(p.shape)} is in two "
                                 "units (a shared or tied weight): leave one of them out of "
                                 "units, so that its parameters go to the root unit")
    if unit is not None:
        return list(unit.parameters())
    root = [p for p in module.parameters() if p not in owner]
    if not root:
        raise ValueError("Zero3: every parameter is in a unit, and the root unit needs some: "
                         "leave one module (e.g. the last layer) out of units")
    return root
