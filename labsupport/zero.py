"""ZeRO stages 1-3 on a flat parameter buffer (chapter 7), reusable with the interfaces users know.

    # ZeRO-1, in place of torch.optim.AdamW(model.parameters(), lr=1e-3):
    opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
    model(ids, targets).backward(); opt.step(); opt.zero_grad()

    # ZeRO-3: each block a unit, the other parameters the root unit
    model = Zero3(model, units=model.blocks)
    opt = torch.optim.AdamW(model.shards.parameters(), lr=1e-3)
    model(ids, targets).backward(); model.sync_gradients(); opt.step(); opt.zero_grad()
    model.full_parameters()                       # {name: full tensor}, on every rank

Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models" (arXiv 1910.02054): stage 1 (P_os) shards the optimizer
state over the N data-parallel ranks, stage 2 (P_os+g) the gradients too,
stage 3 (P_os+g+p) the parameters too. ``FlatParams``, ``zero_step`` and
``Zero3`` are the chapter's own code, kept character-identical to the
notebook's copy by tests/test_zero.py; ``ShardedOptimizer`` gives stage 1
the shape of ``torch.distributed.optim.ZeroRedundancyOptimizer``.
"""
import torch
import torch.distributed as dist
from torch import nn


def check_params(params, what="ZeRO") -> list:
    """The distinct parameters of ``params``; ValueError for what a flat buffer cannot hold."""
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
                   or p.is_sparse and "is sparse" or not p.requires_grad and
                   "does not require grad (freeze nothing, or leave it out)"
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


# Kept equal to the notebook's copy by tests/test_zero.py
class FlatParams:
    """Parameters as views into one flat buffer, padded to N equal shards.

    ZeRO gives each of the N data-parallel ranks one shard of the state
    (Rajbhandari et al. 2020, §5); padding Ψ up to N·⌈Ψ/N⌉ makes the shards
    equal, as reduce-scatter and all-gather need. Shard r is rank r's.
    """

    def __init__(self, params):
        self.params = check_params(params)               # a tied weight once
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.numel = sum(p.numel() for p in self.params)            # Ψ
        self.shard_numel = -(-self.numel // self.world_size)        # ⌈Ψ/N⌉
        first = self.params[0]
        self.data = first.new_zeros(self.shard_numel * self.world_size)
        for p, view in zip(self.params, self.views(self.data)):
            view.copy_(p.detach())
            p.data = view                 # the model now reads the buffer
        self.grad = None

    def views(self, flat):
        """Each parameter's slice of a flat buffer, in the parameter's shape."""
        out, offset = [], 0
        for p in self.params:
            out.append(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        return out

    def shard(self, flat):
        """This rank's slice of a padded flat buffer."""
        start = self.rank * self.shard_numel
        return flat[start:start + self.shard_numel]             # (⌈Ψ/N⌉,)

    def alloc_grads(self):
        """A zeroed flat gradient buffer; backward adds into its views."""
        self.grad = torch.zeros_like(self.data)
        for p, view in zip(self.params, self.views(self.grad)):
            p.grad = view

    def free_grads(self):
        for p in self.params:
            p.grad = None
        self.grad = None

    def reduce_scatter_grads(self):
        """The mean over the ranks of this rank's shard of the gradients."""
        shard = self.grad.new_empty(self.shard_numel)           # (⌈Ψ/N⌉,)
        dist.reduce_scatter_single(shard, self.grad)            # the sum
        return shard.div_(self.world_size)

    def free(self):
        """ZeRO-3: release the full buffer's memory; the views stay, empty."""
        self.data.untyped_storage().resize_(0)

    def gather(self, shard):
        """ZeRO-3: allocate the full buffer again; all-gather the shards."""
        nbytes = self.data.numel() * self.data.element_size()
        self.data.untyped_storage().resize_(nbytes)
        dist.all_gather_single(self.data, shard)


# Kept equal to the notebook's copy by tests/test_zero.py
def zero_step(flat, optimizer, stage):
    """After backward, ZeRO-1 or -2: reduce-scatter, step, all-gather.

    The reduce-scatter leaves each rank the mean gradient of its own shard;
    the optimizer updates only that shard (its state is 1/N of Adam's);
    the all-gather brings every rank the others' updated shards. Each
    collective sends (N-1)/N·Ψ numbers per rank: 2Ψ(N-1)/N in all, as much
    as data parallelism's all-reduce (ZeRO paper §7.2.1).
    """
    grad_shard = flat.reduce_scatter_grads()                    # (⌈Ψ/N⌉,)
    if stage == 1:          # the full gradient buffer stays; my slice: the mean
        grad_shard = flat.shard(flat.grad).copy_(grad_shard)
    else:                   # stage 2: only my shard of the gradients stays
        flat.free_grads()
    param_shard = optimizer.param_groups[0]["params"][0]
    param_shard.grad = grad_shard
    optimizer.step()                                 # on ⌈Ψ/N⌉ elements
    dist.all_gather_single(flat.data, param_shard.detach().clone())


# Kept equal to the notebook's copy by tests/test_zero.py
class Zero3(nn.Module):
    """ZeRO-3 (P_os+g+p): each rank keeps 1/N of every unit's parameters.

    A unit (each module of ``units``, and the root: every other parameter)
    is all-gathered just before its forward and freed after it, gathered
    again just before its backward, and once backward has accumulated all
    its gradients they are reduce-scattered and the full buffers freed:
    3Ψ(N-1)/N numbers sent per rank and step (ZeRO paper §7.2.2).
    """

    def __init__(self, module, units):
        super().__init__()
        self.module, units = module, list(units) + [None]          # None: root
        self.flats = [FlatParams(unit_params(module, units, u)) for u in units]
        self.shards = nn.ParameterList(
            nn.Parameter(f.shard(f.data).clone()) for f in self.flats)
        self.pending = [0] * len(units)     # gradients still to come, by unit
        for i, (unit, flat) in enumerate(zip(units, self.flats)):
            flat.free()
            for p in flat.params:
                p.register_post_accumulate_grad_hook(
                    lambda p, i=i: self._grad_ready(i))
            if unit is not None:
                unit.register_forward_pre_hook(lambda *_, i=i: self._gather(i))
                unit.register_forward_hook(
                    lambda m, args, out, i=i: self._after_forward(i, out))

    def forward(self, *args, **kwargs):
        self._gather(-1)                                # the root unit
        return self._after_forward(-1, self.module(*args, **kwargs))

    def _gather(self, i):
        self.flats[i].gather(self.shards[i].detach())

    def _after_forward(self, i, out):
        self.flats[i].free()
        outs = out if isinstance(out, (tuple, list)) else [out]
        needs = [t for t in outs if torch.is_tensor(t) and t.requires_grad]
        if needs:   # the first gradient flowing back into the unit's output
            torch.autograd.graph.register_multi_grad_hook(
                needs, lambda grads, i=i: self._before_backward(i), mode="any")
        return out

    def _before_backward(self, i):
        self._gather(i)
        self.flats[i].alloc_grads()
        self.pending[i] = len(self.flats[i].params)

    def _grad_ready(self, i):
        self.pending[i] -= 1
        if self.pending[i] == 0:                # the unit's backward is over
            self._reduce(i)

    def _reduce(self, i):
        flat, shard = self.flats[i], self.shards[i]
        grad = flat.reduce_scatter_grads()                      # (⌈Ψ/N⌉,)
        shard.grad = grad if shard.grad is None else shard.grad + grad
        flat.free_grads()
        flat.free()

    def sync_gradients(self):
        """After backward: reduce the units whose parameters went unused."""
        for i, pending in enumerate(self.pending):
            if pending:                 # in the same order on every rank
                self.pending[i] = 0
                self._reduce(i)

    def full_parameters(self):
        """{name: full parameter}, gathered on every rank (for checking)."""
        names = {p: n for n, p in self.module.named_parameters()}
        out = {}
        for i, flat in enumerate(self.flats):
            self._gather(i)
            out.update({names[p]: p.detach().clone() for p in flat.params})
            flat.free()
        return {name: out[name] for name in names.values()}


class ShardedOptimizer:
    """ZeRO-1 with the interface of ``torch.distributed.optim.ZeroRedundancyOptimizer``.

    ``ShardedOptimizer(params, optimizer_cls, **optimizer_kwargs)`` stands in
    for ``optimizer_cls(params, **optimizer_kwargs)`` on a plain (not DDP)
    model: each param group becomes a flat buffer (:class:`FlatParams`) whose
    shard ``rank`` alone is stepped by an ``optimizer_cls`` of its own;
    ``step()`` reduce-scatters the gradients (their mean), steps the shard and
    all-gathers the parameters (:func:`zero_step`, stage 1). Every parameter
    needs a gradient at each step; closures and state dicts are not supported.
    """

    def __init__(self, params, optimizer_cls, **optimizer_kwargs):
        if not (isinstance(optimizer_cls, type)
                and issubclass(optimizer_cls, torch.optim.Optimizer)):
            raise ValueError(f"optimizer_cls must be a torch.optim.Optimizer class such as "
                             f"torch.optim.AdamW, got {optimizer_cls!r}")
        self.optimizer_cls, self.defaults = optimizer_cls, optimizer_kwargs
        self.flats, self.optims, self.param_groups = [], [], []
        groups = [params] if isinstance(params, torch.Tensor) else list(params)
        if groups and not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        if not groups:
            raise ValueError("ShardedOptimizer got no parameters: pass model.parameters() "
                             "or a list of param groups")
        for group in groups:
            self.add_param_group(group)

    def add_param_group(self, param_group: dict):
        """A new group, with its own flat buffer and hyperparameters (as torch.optim)."""
        seen = {p for g in self.param_groups for p in g["params"]}
        params = check_params(param_group["params"], "ShardedOptimizer")
        if seen.intersection(params):
            raise ValueError("ShardedOptimizer: a parameter is in two parameter groups")
        flat = FlatParams(params)
        inner = {k: v for k, v in param_group.items() if k != "params"}
        optim = self.optimizer_cls([{**inner, "params": [flat.shard(flat.data)]}],
                                   **self.defaults)
        self.flats.append(flat)
        self.optims.append(optim)
        self.param_groups.append({**optim.param_groups[0], "params": params})

    @property
    def state(self) -> dict:
        """The wrapped optimizers' state: of this rank's shards only."""
        return {p: s for optim in self.optims for p, s in optim.state.items()}

    def zero_grad(self, set_to_none: bool = True):
        for flat in self.flats:
            if set_to_none or flat.grad is None:
                flat.free_grads()
            else:
                flat.grad.zero_()

    def step(self, closure=None):
        """Reduce-scatter the gradients, step this rank's shards, all-gather."""
        if closure is not None:
            raise NotImplementedError("ShardedOptimizer.step takes no closure: call "
                                      "backward() first, then step()")
        for flat, optim, group in zip(self.flats, self.optims, self.param_groups):
            optim.param_groups[0].update(  # hyperparameters set by the user or a scheduler
                {k: v for k, v in group.items() if k != "params"})
            _grads_into_buffer(flat)
            zero_step(flat, optim, stage=1)

    def state_dict(self):
        raise NotImplementedError("ShardedOptimizer keeps only this rank's shard of the state; "
                                  "saving it is not supported (ZeroRedundancyOptimizer "
                                  "gathers it first, with consolidate_state_dict)")

    def load_state_dict(self, state_dict):
        self.state_dict()


def _grads_into_buffer(flat):
    """Make every .grad a view of the flat gradient buffer (copying it in if needed)."""
    if flat.grad is None:
        flat.grad = torch.zeros_like(flat.data)
    for i, (p, view) in enumerate(zip(flat.params, flat.views(flat.grad))):
        if p.grad is None:
            raise ValueError(f"ShardedOptimizer: parameter {i} (shape {tuple(p.shape)}) has "
                             "no gradient: a flat shard is stepped as a whole, so every "
                             "parameter needs one (leave unused parameters out)")
        if p.grad.data_ptr() != view.data_ptr():
            view.copy_(p.grad)
            p.grad = view
