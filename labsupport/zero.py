"""ZeRO stages 1-3 on a flat parameter buffer (chapter 7), reusable with the interfaces users know.

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
notebook's copy by tests/test_zero.py; ``labsupport.sharded_optimizer``
gives stage 1 the shape of ``torch.distributed.optim.ZeroRedundancyOptimizer``.
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


# --- lesson: notebooks/07_zero_fsdp.ipynb (the notebook's copy must match) ---
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
# --- end of lesson ---
