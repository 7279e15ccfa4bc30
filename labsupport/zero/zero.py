"""ZeRO stages 1-3 on a flat parameter buffer (chapter 7), reusable with the interfaces users know.

    # ZeRO-3: each block a unit, the other parameters the root unit
    model = Zero3(model, units=model.blocks, compute_dtype=torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)    # the fp32 shards
    model(ids, targets).backward(); model.clip_grad_norm_(1.0); opt.step(); opt.zero_grad()
    model.full_parameters()                       # {name: full tensor}, on every rank

Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models" (arXiv 1910.02054): stage 1 (P_os) shards the optimizer
state over the N data-parallel ranks, stage 2 (P_os+g) the gradients too,
stage 3 (P_os+g+p) the parameters too. ``FlatParams``, ``zero_step`` and
``Zero3`` are the chapter's own code, kept character-identical to the
notebook's copy by tests/test_zero.py; ``labsupport.zero.sharded_optimizer``
gives stage 1 the shape of ``torch.distributed.optim.ZeroRedundancyOptimizer``.
"""
import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable

from labsupport.zero.args import check_params, unit_params


# --- lesson: notebooks/07_zero_fsdp.ipynb (the notebook's copy must match) ---
class FlatParams:
    """Parameters as views into one flat buffer, padded to N equal shards.

    ZeRO gives each of the N data-parallel ranks one shard of the state
    (Rajbhandari et al. 2020, §5); padding Ψ up to N·⌈Ψ/N⌉ makes the shards
    equal, as reduce-scatter and all-gather need. Shard r is rank r's.
    """

    def __init__(self, params):
        self.params = check_params(params)               # a tied weight once
        self.shapes = [p.shape for p in self.params]
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.numel = sum(p.numel() for p in self.params)            # Ψ
        self.shard_numel = -(-self.numel // self.world_size)        # ⌈Ψ/N⌉
        first = self.params[0]
        self.data = first.new_zeros(self.shard_numel * self.world_size)
        for p, view in zip(self.params, self.views(self.data)):
            view.copy_(p.detach())
        self.use(self.views(self.data))   # the model now reads the buffer
        self.grad = None

    def views(self, flat):
        """Each parameter's slice of a flat buffer, in the parameter's shape."""
        out, offset = [], 0
        for shape in self.shapes:
            out.append(flat[offset:offset + shape.numel()].view(shape))
            offset += shape.numel()
        return out

    def use(self, tensors):
        """Point each parameter at its tensor (the model computes with it)."""
        for p, tensor in zip(self.params, tensors):
            p.data = tensor

    def shard(self, flat):
        """This rank's slice of a padded flat buffer."""
        start = self.rank * self.shard_numel
        return flat[start:start + self.shard_numel]             # (⌈Ψ/N⌉,)

    def pieces(self, shard):
        """Each parameter's elements inside this rank's shard: 1-D views of
        ``shard``, empty for a parameter that lies in other ranks' shards."""
        out, offset = [], -self.rank * self.shard_numel   # shard coordinates
        for shape in self.shapes:
            lo, hi = offset, offset + shape.numel()
            out.append(shard[max(lo, 0):max(min(hi, self.shard_numel), 0)])
            offset = hi
        return out

    def alloc_grads(self):
        """A zeroed flat gradient buffer; backward adds into its views."""
        self.grad = torch.zeros_like(self.data)
        for p, view in zip(self.params, self.views(self.grad)):
            p.grad = view

    def free_grads(self):
        for p in self.params:
            p.grad = None
        self.grad = None

    def reduce_scatter_grads(self, dtype=None):
        """The mean over the ranks of this rank's shard of the gradients,
        reduced in ``dtype`` (default: the gradients' own)."""
        grad = self.grad.to(dtype or self.grad.dtype)
        shard = grad.new_empty(self.shard_numel)                # (⌈Ψ/N⌉,)
        dist.reduce_scatter_single(shard, grad)                 # the sum
        return shard.div_(self.world_size)

    def to(self, dtype):
        """ZeRO-3: gather and compute in ``dtype`` (the full buffer's)."""
        self.data = self.data.to(dtype)
        self.use(self.views(self.data))

    def free(self):
        """ZeRO-3: release the full buffer's memory; the views stay, empty."""
        self.data.untyped_storage().resize_(0)

    def gather(self, shard):
        """ZeRO-3: allocate the full buffer again; start the all-gather of
        the shards (cast to the buffer's dtype); return its work."""
        nbytes = self.data.numel() * self.data.element_size()
        self.data.untyped_storage().resize_(nbytes)
        return dist.all_gather_single(self.data, shard.to(self.data.dtype),
                                      async_op=True)


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


class Zero3(nn.Module):
    """ZeRO-3 (P_os+g+p): each rank keeps 1/N of every unit's parameters.

    A unit (each module of ``units``, listed in the order forward runs
    them, and the root: every other parameter) is all-gathered just before
    its forward and freed after it, gathered again just before its
    backward, and once backward has accumulated all its gradients they are
    reduce-scattered and the full buffers freed: 3Ψ(N-1)/N numbers sent per
    rank and step (ZeRO paper §7.2.2). ``prefetch``: start the next unit's
    all-gather before waiting for this one's, so that it moves while this
    unit computes. ``compute_dtype`` (e.g. torch.bfloat16): gather and
    compute in it; the shards, the optimizer and the gradients' reduction
    keep the parameters' dtype. ``parameters()`` are the shards (give them
    to the optimizer). Outside forward and backward each parameter of the
    module is its piece of this rank's shard (``FlatParams.pieces``), and
    after backward its ``.grad`` the same piece of the shard's gradient.
    """

    def __init__(self, module, units, compute_dtype=None, prefetch=True):
        super().__init__()
        self.module, units = module, list(units) + [None]          # None: root
        self.flats = [FlatParams(unit_params(module, units, u)) for u in units]
        self.shards = nn.ParameterList(
            nn.Parameter(f.shard(f.data).clone()) for f in self.flats)
        self.prefetch, self.works = prefetch, {}   # unit: all-gather started
        self.pending = [0] * len(units)     # gradients still to come, by unit
        for i, (unit, flat) in enumerate(zip(units, self.flats)):
            flat.to(compute_dtype or flat.data.dtype)
            self._free(i)
            for p in flat.params:
                p.register_post_accumulate_grad_hook(
                    lambda p, i=i: self._grad_ready(i))
            if unit is not None:
                unit.register_forward_pre_hook(
                    lambda *_, i=i: self._gather(i, self._next(i)))
                unit.register_forward_hook(
                    lambda m, args, out, i=i: self._after_forward(i, out))

    def forward(self, *args, **kwargs):
        root = len(self.flats) - 1
        self._gather(root, self._next(root))
        dtype = self.flats[root].data.dtype     # floating inputs: cast them
        args = [a.to(dtype) if torch.is_tensor(a) and a.is_floating_point()
                else a for a in args]
        return self._after_forward(root, self.module(*args, **kwargs))

    def _next(self, i, backward=False):
        """The unit after unit i: forward runs the root, 0, 1, ..., backward
        the root, ..., 1, 0 (None: none)."""
        root = len(self.flats) - 1
        j = (root - 1 if backward else 0) if i == root else (
            i - 1 if backward else i + 1)
        return j if 0 <= j < root else None

    def _gather(self, i, then=None):
        """Unit i's full parameters, now; unit ``then``'s, started."""
        work = self.works.pop(i, None) or self.flats[i].gather(
            self.shards[i].detach())
        if self.prefetch and then is not None and then not in self.works:
            self.works[then] = self.flats[then].gather(
                self.shards[then].detach())
        work.wait()
        self.flats[i].use(self.flats[i].views(self.flats[i].data))

    def _free(self, i):
        self.flats[i].free()
        self.flats[i].use(self.flats[i].pieces(self.shards[i].detach()))

    def _after_forward(self, i, out):
        self._free(i)
        outs = out if isinstance(out, (tuple, list)) else [out]
        needs = [t for t in outs if torch.is_tensor(t) and t.requires_grad]
        if needs:   # the first gradient flowing back into the unit's output
            torch.autograd.graph.register_multi_grad_hook(
                needs, lambda grads, i=i: self._before_backward(i), mode="any")
        return out

    def _before_backward(self, i):
        if i == len(self.flats) - 1:    # the root: backward has just begun
            Variable._execution_engine.queue_callback(self.sync_gradients)
        self._gather(i, self._next(i, backward=True))
        self.flats[i].alloc_grads()
        self.pending[i] = len(self.flats[i].params)

    def _grad_ready(self, i):
        self.pending[i] -= 1
        if self.pending[i] == 0:                # the unit's backward is over
            self._reduce(i)

    def _reduce(self, i):
        flat, shard = self.flats[i], self.shards[i]
        grad = flat.reduce_scatter_grads(shard.dtype)           # (⌈Ψ/N⌉,)
        shard.grad = grad if shard.grad is None else shard.grad + grad
        flat.free_grads()
        self._free(i)
        for p, piece in zip(flat.params, flat.pieces(shard.grad)):
            p.grad = piece              # readable: my piece of its gradient

    def sync_gradients(self):
        """The end of backward (autograd calls it): reduce the units whose
        parameters went unused; drop the all-gathers nobody used."""
        for i, work in self.works.items():
            work.wait()
            self._free(i)
        self.works = {}
        for i, pending in enumerate(self.pending):
            if pending:                 # in the same order on every rank
                self.pending[i] = 0
                self._reduce(i)

    def named_parameters(self, prefix="", recurse=True, remove_duplicate=True):
        """The shards only: the module's parameters are views into them."""
        return self.shards.named_parameters(
            prefix + ("." if prefix else "") + "shards", recurse,
            remove_duplicate)

    def clip_grad_norm_(self, max_norm):
        """torch.nn.utils.clip_grad_norm_ on the whole model's gradient: the
        norm of all ranks' shards (padding adds zeros), each scaled alike."""
        grads = [s.grad for s in self.shards if s.grad is not None]
        total = self.shards[0].new_zeros(())
        for g in grads:
            total += g.pow(2).sum()
        dist.all_reduce(total)                  # the sum of squares, every rank
        norm = total.sqrt()
        scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)   # as torch's
        for g in grads:
            g.mul_(scale)
        return norm

    def full_parameters(self):
        """{name: full parameter}, gathered on every rank (for checking)."""
        names = {p: n for n, p in self.module.named_parameters()}
        out = {}
        for flat, shard in zip(self.flats, self.shards):
            full = shard.new_empty(flat.data.numel())    # the shards' dtype
            dist.all_gather_single(full, shard.detach())
            out.update({names[p]: view.clone()
                        for p, view in zip(flat.params, flat.views(full))})
        return {name: out[name] for name in names.values()}
# --- end of lesson ---
