"""Point-to-point patterns that work on gloo and hang on NCCL, for tests/test_strict_p2p.py.

Each is what the course's code did before issue 25 (chapter 5's harness,
chapter 2's pipelined ring, chapter 1's direct all-gather, chapter 6's ring
step), kept here, in its own module that imports only torch and labsupport
(the ranks import it to unpickle each function), to show that
LABSUPPORT_P2P=strict catches it.
"""
import torch
import torch.distributed as dist

from labsupport import models
from labsupport.pipeline import pipeline

# -- chapter 5 before: every receive posted first (tagged irecv), sends by isend ------


class OldPipelineRank:
    """One stage per rank, m micro-batches, messages named by tags."""

    def __init__(self, m):
        self.rank, self.world_size, self.m, self.v = dist.get_rank(), dist.get_world_size(), m, 1
        model = models.DeepMLP(d_in=8, width=16, depth=self.world_size + 1, d_out=4, seed=0)
        self.stage = pipeline.split_stages(model, self.world_size)[self.rank]
        x, y = models.toy_regression(4 * m, 8, 4, seed=1)
        self.inputs, self.targets = x.chunk(m), y.chunk(m)
        self.stash, self.sends, self.posted = {}, [], {}
        for i in range(m):  # every receive of the step, posted at once
            for grad, peer in ((False, self.rank - 1), (True, self.rank + 1)):
                if 0 <= peer < self.world_size:
                    buffer = torch.empty(4, 16)
                    self.posted[i, grad] = (buffer, dist.irecv(buffer, peer, tag=2 * i + grad))

    def receive(self, i, grad):
        buffer, work = self.posted.pop((i, grad))
        work.wait()
        return buffer

    def forward(self, s, i):
        last = s == self.world_size - 1
        x = self.inputs[i] if s == 0 else self.receive(i, False).requires_grad_()
        y = self.stage(x)
        if last:
            y = torch.nn.functional.mse_loss(y, self.targets[i]) / self.m
        else:
            self.sends.append(dist.isend(y.detach(), s + 1, tag=2 * i))
        self.stash[i] = (x, y)

    def backward(self, s, i):
        x, y = self.stash.pop(i)
        dy = None if s == self.world_size - 1 else self.receive(i, True)
        torch.autograd.backward(y, dy)
        if s > 0:
            self.sends.append(dist.isend(x.grad, s - 1, tag=2 * i + 1))


def old_pipeline_1f1b(m=4):
    """Chapter 5's 1F1B on the old harness; the loss on the last rank, else None."""
    pp = OldPipelineRank(m)
    pipeline.train_step_1f1b(pp)
    for work in pp.sends:
        work.wait()
    return sum(p.grad.sum().item() for p in pp.stage.parameters())


# -- chapter 2 before: segments sent ahead of the receives -------------------------------

WINDOW = 4


def old_pipelined_ring(tensor, segment_bytes=4096):
    """The old chapter 2 ring_allreduce: own chunk's segments all sent at once,
    receives posted WINDOW ahead, each arrival sent on as soon as it is added."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    chunks = tensor.view(-1).tensor_split(world_size)
    seg = max(1, min(segment_bytes // tensor.element_size(), len(chunks[0])))
    scratch = tensor.new_empty(WINDOW, seg)
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    sends = [dist.isend(p, right) for p in chunks[(rank - 1) % world_size].split(seg)]
    inbox = [(step, part) for step in range(2 * (world_size - 1))
             for part in chunks[(rank - step - 2) % world_size].split(seg)]

    def post(i):
        step, part = inbox[i]
        into = scratch[i % WINDOW, :part.numel()] if step < world_size - 1 else part
        return dist.irecv(into, left)

    pending = [post(i) for i in range(min(WINDOW, len(inbox)))]
    for i, (step, part) in enumerate(inbox):
        pending.pop(0).wait()
        if step < world_size - 1:
            part += scratch[i % WINDOW, :part.numel()]
        if step < 2 * world_size - 3:
            sends.append(dist.isend(part, right))
        if i + WINDOW < len(inbox):
            pending.append(post(i + WINDOW))
    for work in sends:
        work.wait()
    return tensor


# -- chapter 1 before: the direct all-gather, unbatched isends to every peer -------------

def old_direct_all_gather(tensor):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    chunks = tensor.view(-1).tensor_split(world_size)
    others = [r for r in range(world_size) if r != rank]
    works = [dist.isend(chunks[rank], r) for r in others]
    works += [dist.irecv(chunks[r], r) for r in others]
    for work in works:
        work.wait()
    return tensor


# -- chapter 6 before: one ring step, an isend and an irecv posted apart ------------------

def old_ring_step(tensor):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    incoming = torch.empty_like(tensor)
    works = [dist.isend(tensor, (rank + 1) % world_size),
             dist.irecv(incoming, (rank - 1) % world_size)]
    for work in works:
        work.wait()
    return incoming


def filled(numel):
    """This rank's input: rank + 1 everywhere."""
    return torch.full((numel,), float(dist.get_rank() + 1))
