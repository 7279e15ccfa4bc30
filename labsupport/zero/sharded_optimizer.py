"""ZeRO-1 with the interface users know: ``torch.distributed.optim.ZeroRedundancyOptimizer``.

    # in place of torch.optim.AdamW(model.parameters(), lr=1e-3):
    opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
    model(ids, targets).backward(); opt.step(); opt.zero_grad()

Built on chapter 7's flat buffer (``labsupport.zero.zero.FlatParams``): stage 1
of Rajbhandari et al., "ZeRO" (arXiv 1910.02054), the optimizer state
sharded over the data-parallel ranks.
"""
import torch

from labsupport.zero.zero import FlatParams, check_params, zero_step


class ShardedOptimizer:
    """ZeRO-1 with the interface of ``torch.distributed.optim.ZeroRedundancyOptimizer``.

    ``ShardedOptimizer(params, optimizer_cls, **optimizer_kwargs)`` stands in
    for ``optimizer_cls(params, **optimizer_kwargs)`` on a plain (not DDP)
    model: each param group becomes a flat buffer (:class:`FlatParams`) whose
    shard ``rank`` alone is stepped by an ``optimizer_cls`` of its own;
    ``step()`` reduce-scatters the gradients (their mean), steps the shard and
    all-gathers the parameters (:func:`zero_step`, stage 1). Frozen
    parameters (``requires_grad=False``) are accepted and left untouched, as
    torch's optimizers leave them (they stay out of the flat buffers, so
    unfreezing one later needs a new ShardedOptimizer); every other parameter
    needs a gradient at each step. Closures and state dicts are not supported.
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
        params = check_params(param_group["params"], "ShardedOptimizer", frozen=True)
        if seen.intersection(params):
            raise ValueError("ShardedOptimizer: a parameter is in two parameter groups")
        trainable = [p for p in params if p.requires_grad]     # frozen: untouched
        flat = FlatParams(trainable) if trainable else None
        inner = {k: v for k, v in param_group.items() if k != "params"}
        shard = [flat.shard(flat.data)] if flat else [torch.zeros(0, requires_grad=True)]
        optim = self.optimizer_cls([{**inner, "params": shard}], **self.defaults)
        self.flats.append(flat)
        self.optims.append(optim)
        self.param_groups.append({**optim.param_groups[0], "params": params})

    @property
    def state(self) -> dict:
        """The wrapped optimizers' state: of this rank's shards only."""
        return {p: s for optim in self.optims for p, s in optim.state.items()}

    def zero_grad(self, set_to_none: bool = True):
        for flat in filter(None, self.flats):
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
            _still_frozen(group["params"], flat)
            if flat is None:
                continue
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


def _still_frozen(params, flat):
    """ValueError for a parameter frozen when its group was added and trainable now."""
    flat_params = set(flat.params) if flat else set()
    for i, p in enumerate(params):
        if p.requires_grad and p not in flat_params:
            raise ValueError(f"ShardedOptimizer: parameter {i} (shape {tuple(p.shape)}) was "
                             "frozen when its group was added and requires grad now: build "
                             "a new ShardedOptimizer after unfreezing it")


def _grads_into_buffer(flat):
    """Make every .grad a view of the flat gradient buffer (copying it in if needed)."""
    if flat.grad is None:
        flat.grad = torch.zeros_like(flat.data)
    for i, (p, view) in enumerate(zip(flat.params, flat.views(flat.grad))):
        if p.grad is None:
            raise ValueError(f"ShardedOptimizer: parameter {i} (shape {tuple(p.shape)}) has "
                             "no gradient: a flat shard is stepped as a whole, so every "
                             "trainable parameter needs one (leave unused parameters out, "
                             "or freeze them before building the optimizer)")
        if p.grad.data_ptr() != view.data_ptr():
            view.copy_(p.grad)
            p.grad = view
