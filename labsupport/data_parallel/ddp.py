"""Data parallelism written by hand: chapter 3's three versions, for later chapters.

    model = DataParallelBucket(DeepMLP(seed=0), bucket_size=2**18)  # on every rank
    loss_fn(model(x_shard), y_shard).backward()
    model.sync_gradients()            # every rank now holds the mean gradient
    optimizer.step()

Each rank runs the same model on its own shard of the batch; averaging the
gradients over the ranks gives the gradient of the full batch, so N ranks
train exactly like one process would (Li et al., "PyTorch Distributed:
Experiences on Accelerating Data Parallel Training", VLDB 2020, arXiv
2006.15704, §3.2). The versions go from the starting point to what
PyTorch's DistributedDataParallel does:

- ``DataParallelNaive``: after backward, one all-reduce per gradient;
- ``DataParallelOverlap``: each gradient's all-reduce starts, asynchronously,
  as soon as backward has produced it, hidden behind the rest of backward;
- ``DataParallelBucket``: the same overlap with fewer, larger messages
  (gradients packed into buckets of about ``bucket_size`` bytes).

The notebook notebooks/03_data_parallel.ipynb writes the same code in its
cells; tests/test_ddp.py keeps both copies identical, so edit them together.
Every version starts by copying rank 0's parameters and buffers to every
rank (``broadcast_parameters``), as DDP's constructor does, so ranks whose
models were built differently still train one model. The mean is a SUM
all-reduce and a division by N, written out where ``ReduceOp.AVG`` would hide
it; here the division comes after the all-reduce (fp32 sums of these sizes
cannot overflow), where DDP's hooks divide before it (``allreduce_hook`` in
torch/distributed/algorithms/ddp_comm_hooks/default_hooks.py), which keeps
low-precision sums in range. Chapter 3's first exercise removes the division
to see what breaks.
"""
import contextlib

import torch
import torch.distributed as dist
from torch import nn


# --- lesson: notebooks/03_data_parallel.ipynb (the notebook's copy must match) ---
def broadcast_parameters(module):
    """Copy rank 0's parameters and buffers to every rank, in place.

    What DDP's constructor does (``_sync_module_states`` in
    torch/distributed/utils.py): every parameter, frozen ones included, and
    every buffer. Tied weights are one tensor, sent once.
    """
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            dist.broadcast(tensor, src=0)


class DataParallelNaive(nn.Module):
    """The starting point: after backward, all-reduce each gradient, average.

    One blocking all-reduce per parameter tensor, issued only once the whole
    backward pass is over: simple and correct, but the network idles during
    backward and the compute idles during communication (Li et al. 2020,
    §3.2.1, "a naive solution").
    """

    def __init__(self, module):
        super().__init__()
        self.module = module
        self.world_size = dist.get_world_size()
        broadcast_parameters(module)  # every rank starts from rank 0's model

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def sync_gradients(self):
        for param in self.module.parameters():
            if param.grad is not None:
                dist.all_reduce(param.grad)         # SUM over the ranks
                param.grad /= self.world_size       # -> the mean gradient


class DataParallelOverlap(DataParallelNaive):
    """All-reduce each gradient as soon as it is ready; wait before the step.

    A hook fires when backward has accumulated a parameter's gradient and
    starts that gradient's all-reduce asynchronously, so communication runs
    while backward computes the earlier layers (Li et al. 2020, §3.2.3).
    """

    def __init__(self, module):
        params = [p for p in module.parameters() if p.requires_grad]
        if any(hasattr(p, "_dp_hook") for p in params):
            raise ValueError(  # its hooks would fire twice: N-fold gradients
                "this module's parameters are already wrapped for data "
                "parallelism: wrap a module once, or close() the old wrapper")
        super().__init__(module)
        self.works, self.sync = [], True
        for param in params:
            param._dp_hook = param.register_post_accumulate_grad_hook(
                self._grad_ready)

    def close(self):
        """Remove the hooks: the module can be used alone or wrapped again."""
        for param in self.module.parameters():
            if hasattr(param, "_dp_hook"):
                param._dp_hook.remove()
                del param._dp_hook

    def _grad_ready(self, param):
        if self.sync:
            work = dist.all_reduce(param.grad, async_op=True)
            self.works.append((param, work))

    def sync_gradients(self):
        for param, work in self.works:
            work.wait()
            param.grad /= self.world_size
        self.works.clear()

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally, no all-reduce (Li et al. §3.2.4)."""
        self.sync = False
        try:
            yield
        finally:
            self.sync = True


def bucket_params(params, bucket_size):
    """Split ``params`` (in the order their gradients arrive) into buckets.

    A bucket takes parameters until the next one would push it past
    ``bucket_size`` bytes; every bucket holds at least one parameter.
    """
    if bucket_size < 0:
        raise ValueError(f"bucket_size is in bytes, >= 0; got {bucket_size}")
    if not params:
        raise ValueError("no parameter requires a gradient: nothing to sync")
    buckets, size = [[]], 0
    for param in params:
        nbytes = param.numel() * param.element_size()
        if buckets[-1] and size + nbytes > bucket_size:
            buckets, size = buckets + [[]], 0
        buckets[-1].append(param)
        size += nbytes
    return buckets


class DataParallelBucket(DataParallelOverlap):
    """The overlap, with one all-reduce per bucket of gradients, like DDP.

    Each all-reduce pays a fixed latency; packing gradients into buckets of
    about ``bucket_size`` bytes pays it once per bucket and keeps the overlap
    (Li et al. 2020, §3.2.2-3; DDP's ``bucket_cap_mb``). Buckets are filled in
    reverse parameter order, the order in which backward produces gradients.
    """

    def __init__(self, module, bucket_size=2**20):
        super().__init__(module)    # its hooks call this class's _grad_ready
        params = [p for p in module.parameters() if p.requires_grad]
        self.buckets = bucket_params(params[::-1], bucket_size)
        self.bucket_of = {p: i for i, b in enumerate(self.buckets) for p in b}
        self.pending = [len(b) for b in self.buckets]  # gradients not yet ready
        self.works = {}                                # bucket -> (flat, work)

    def _grad_ready(self, param):
        i = self.bucket_of[param]
        self.pending[i] -= 1
        if self.pending[i] == 0:                       # the bucket is complete
            self.pending[i] = len(self.buckets[i])
            if self.sync:
                flat = torch.cat([p.grad.flatten() for p in self.buckets[i]])
                self.works[i] = (flat, dist.all_reduce(flat, async_op=True))

    def sync_gradients(self):
        if len(self.works) != len(self.buckets):
            done = len(self.works)
            self.reset()  # else the next backward starts from this one's counts
            raise RuntimeError(
                f"only {done} of {len(self.buckets)} buckets were "
                "all-reduced: call sync_gradients once after each backward "
                "outside no_sync(), with every parameter used in forward")
        for i, (flat, work) in self.works.items():
            work.wait()
            flat /= self.world_size
            grads = flat.split([p.numel() for p in self.buckets[i]])
            for param, grad in zip(self.buckets[i], grads):
                param.grad.copy_(grad.view_as(param))
        self.works.clear()

    def reset(self):
        """Forget a backward that went wrong: finish its all-reduces,
        count every bucket's gradients afresh."""
        for flat, work in self.works.values():
            work.wait()
        self.works.clear()
        self.pending = [len(b) for b in self.buckets]
# --- end of lesson ---
