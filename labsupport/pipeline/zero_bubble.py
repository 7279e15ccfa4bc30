"""The harness of assignment 3 (the zero-bubble pipeline): F, B and W on chapter 5's messages.

    grading.run(zero_bubble.Step(name, schedule, (input_grad, weight_grad), m))
    grading.run(zero_bubble.Step(name, schedule, None, m))  # B and W by autograd

Zero Bubble Pipeline Parallelism (Qi, Wan, Huang & Lin, arXiv 2401.10241,
ICLR 2024) splits a stage's backward in two: **B**, the gradient with respect
to the stage's input (dL/dx = dL/dz W for a linear layer z = x W^T + b),
which the previous stage waits for, and **W**, the gradient with respect to
the weights (dL/dW = dL/dz^T x), which nobody waits for. The student writes
B and W for one stage, and a schedule: the order of ``pp.forward``,
``pp.backward_input`` and ``pp.backward_weight`` calls. The reference
solution lives only in the instructors' source notebook
(notebooks/assignments/source/zero_bubble_pipeline), never here.

The harness is chapter 5's (``labsupport.pipeline.pipeline``: the plan of messages
from the ideal machine, each batch posted once its sends are made,
``PipelineRank``). With the student's B and W, the stage's
Linear layers run on detached weights, so that autograd can only give
dL/dx and each layer's dL/dz, and W must compute the weight gradients
itself. Without them (``fns=None``: the checks that grade the schedule
alone) autograd does both halves, on the weights themselves: B takes
dL/dx and keeps the graph, W takes the weights' gradients from it.

What ran is recorded, not timed: each rank's calls in the order they ran
(``ran``), the messages each call received before it computed
(``received``: call -> [(stage, mb, grad), ...]) and the call whose result
each message it sent carries (``made``). The grader plays that record in
units (``pipeline_sim.play``), so its idle fraction is the schedule's as
it ran, and no clock or load enters it. The checks are in
``labsupport.grading.zero_bubble_pipeline``.
"""
import contextlib
import threading

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from labsupport import models
from labsupport.checking.diagnosis import name_of
from labsupport.pipeline import pipeline
from labsupport.pipeline import sim as pipeline_sim

MODEL_KW = dict(d_in=32, width=64, depth=9, d_out=8, seed=0)
ROWS = 8  # samples per micro-batch


# -- the order the assignment improves on ---------------------------------------------

def train_step_1f1b_split(pp):
    """1F1B with each backward split into B then, at once, W: the order to improve on."""
    warmup = min(pp.world_size - pp.rank - 1, pp.m)
    for i in range(warmup):
        pp.forward(pp.rank, i)
    for i in range(pp.m - warmup):
        pp.forward(pp.rank, warmup + i)
        pp.backward_input(pp.rank, i)
        pp.backward_weight(pp.rank, i)
    for i in range(pp.m - warmup, pp.m):
        pp.backward_input(pp.rank, i)
        pp.backward_weight(pp.rank, i)


# -- on the ranks -----------------------------------------------------------------------

class ZBRank(pipeline.PipelineRank):
    """Chapter 5's PipelineRank with F, B and W, and a record of what ran.

    ``fns``: the student's (input_grad, weight_grad), or None for autograd's.
    ``ran``: the calls in the order they ran; ``received[call]``: the messages
    (stage, mb, grad) it waited for; ``made[message]``: the call it carries.
    (``waited`` is chapter 5's count of batches waited for.)
    """

    def __init__(self, stages, x, y, m, hidden, plan, fns):
        super().__init__(stages, x, y, m, hidden, plan)
        self.fns, self.wstash = fns, {}
        self.ran, self.received, self.made, self.inbox = [], {}, {}, []

    @contextlib.contextmanager
    def compute(self, name, s, i):
        """One call's computation; it waited for the messages received since
        the last call."""
        with self.tl.span("compute", name, mb=i, stage=s):
            yield
        self.received[name, s, i], self.inbox = self.inbox, []
        self.ran.append((name, s, i))

    def send(self, tensor, stage, i, grad=False):
        """Chapter 5's send of the result of the call that ran last."""
        self.made[stage, i, grad] = self.ran[-1]
        pipeline.send(self, tensor, stage, i, grad)

    def forward(self, s, i):
        last = s == self.num_stages - 1
        x = self.inputs[i] if s == 0 else self.recv(s, i)
        x = x.detach().requires_grad_()
        with self.compute("F", s, i):
            h, layers = x, []
            for module in _leaves(self.stages[s]):
                if isinstance(module, nn.Linear) and self.fns is not None:
                    weight, bias = module.weight.detach(), module.bias.detach()
                    z = F.linear(h, weight, bias)  # detached: B gives no dL/dW
                    layers.append((module, h.detach(), z))  # W: h, dL/dz
                    h = z
                else:
                    h = module(h)
            y = F.mse_loss(h, self.targets[i]) / self.m if last else h
        if last:
            self.losses.append(y.detach())
        else:
            self.send(y, s + 1, i)
        self.stash[s, i] = (x, y, layers)
        self.peak = max(self.peak, len(self.stash) + len(self.wstash))

    def backward_input(self, s, i):
        x, y, layers = self.stash.pop((s, i))
        dy = None if s == self.num_stages - 1 else self.recv(s, i, grad=True)
        with self.compute("B", s, i):
            dx, for_w = self._input_grad(s, x, y, dy, layers)
        if s > 0:
            self.send(dx, s - 1, i, grad=True)
        self.wstash[s, i] = for_w

    def backward_weight(self, s, i):
        if (s, i) not in self.wstash:
            raise AssertionError(f"rank {self.rank} called W of micro-batch {i} before its "
                                 "B (or twice): W needs the dL/dz that B computes")
        for_w = self.wstash.pop((s, i))
        with self.compute("W", s, i):
            self._weight_grad(s, i, for_w)

    def backward(self, s, i):
        """The chapter's backward: B and W at once, dx sent after both (so its
        message carries W's end: the previous stage waits for both)."""
        x, y, layers = self.stash.pop((s, i))
        dy = None if s == self.num_stages - 1 else self.recv(s, i, grad=True)
        with self.compute("B", s, i):
            dx, for_w = self._input_grad(s, x, y, dy, layers)
        with self.compute("W", s, i):
            self._weight_grad(s, i, for_w)
        if s > 0:
            self.send(dx, s - 1, i, grad=True)

    def _input_grad(self, s, x, y, dy, layers):
        """B: (dL/dx, what W needs): the student's dL/dz's, or autograd's kept graph."""
        if self.fns is None:
            (dx,) = torch.autograd.grad(y, [x], dy, retain_graph=True)
            return dx, (y, dy)
        before = self._grads(s)
        dx, dzs = self.fns[0](x, y, dy, [z for _, _, z in layers])
        _check_b(name_of(self.fns[0]), self._grads(s), before, s, layers, dx, dzs, x)
        return dx, (layers, list(dzs))

    def _weight_grad(self, s, i, for_w):
        """W: every weight's gradient of stage s added into .grad."""
        if self.fns is None:
            y, dy = for_w
            torch.autograd.backward(y, dy, inputs=list(self.stages[s].parameters()))
            return
        before = self._grads(s)
        with torch.no_grad():
            self.fns[1](*for_w)
        if all(torch.equal(a, b) for a, b in zip(self._grads(s), before)):
            raise AssertionError(f"{name_of(self.fns[1])} left every .grad of stage {s} "
                                 f"unchanged (micro-batch {i}): W must add dz^T h and "
                                 "dz.sum(0) into each Linear's weight.grad and bias.grad")

    def recv(self, s, i, grad=False):
        """Chapter 5's recv; under a plan of calls as written (a schedule that
        deadlocks), a message no batch can bring yet is waited for forever."""
        pipeline.post_ready(self)
        if (s, i, grad) not in self.posted:
            threading.Event().wait()  # the deadline stops this rank
        buffer = pipeline.recv(self, s, i, grad)
        self.inbox.append((s, i, grad))  # the next call to compute waited for it
        return buffer

    def _grads(self, s):
        return [q.grad.clone() for q in self.stages[s].parameters()]


def _leaves(module):
    return [mod for mod in module.modules() if not list(mod.children())]



def _check_b(name, after, before, s, layers, dx, dzs, x):
    if not all(torch.equal(a, b) for a, b in zip(after, before)):
        raise AssertionError(f"{name} changed the weight gradients of stage {s}: B "
                             "computes only dL/dx and each layer's dL/dz; dL/dW is W's work "
                             "(backward_weight), which the schedule runs later")
    shapes = [tuple(z.shape) for _, _, z in layers]
    got = [tuple(getattr(d, "shape", ())) for d in (dzs or [])]
    if got != shapes or getattr(dx, "shape", None) != x.shape:
        raise AssertionError(f"{name} must return (dx, dzs): dx shaped like the "
                             f"stage input {tuple(x.shape)}, and one dL/dz per Linear layer "
                             f"shaped like its output z, {shapes}; got dx "
                             f"{tuple(getattr(dx, 'shape', ()))} and dzs {got}")


class Step:
    """What grading.run runs on each rank: one step of ``schedule``, recorded.

    ``fns``: the student's (input_grad, weight_grad), or None for autograd's B and W.
    """

    def __init__(self, name, schedule, fns, m):
        self.__name__, self.args = name, (schedule, fns, m)

    def __call__(self):
        schedule, fns, m = self.args
        p = dist.get_world_size()
        model = models.DeepMLP(**MODEL_KW)
        for q in model.parameters():
            q.grad = torch.zeros_like(q)
        x, y = data(m)
        pp = ZBRank(pipeline.split_stages(model, p), x, y, m, MODEL_KW["width"],
                    _plan(schedule, p, m), fns)
        dist.barrier()  # start the step together
        schedule(pp)
        pipeline.wait_for(pp, len(pp.batches))  # the step's last sends too
        own = {id(q) for stage in pp.stages.values() for q in stage.parameters()}
        grads = {n: q.grad for n, q in model.named_parameters() if id(q) in own}
        loss = torch.stack(pp.losses).sum() if pp.losses else None
        return dict(grads=grads, loss=loss, peak=pp.peak, ran=pp.ran, received=pp.received,
                    made=pp.made)


def _plan(schedule, p, m):
    """Chapter 5's plan of messages; for a schedule that deadlocks on the ideal
    machine, its calls as written, so that it hangs where it would and the
    grader's deadline explains it. Only F and B carry messages: the plan is
    made from them alone, so a schedule whose W's are wrong still runs and is
    graded on them."""
    rank, f_and_b = dist.get_rank(), (lambda pp: schedule(_WithoutW(pp)))
    try:
        return pipeline_sim.message_plan(f_and_b, p, m, 1, rank)
    except RuntimeError:  # pipeline_sim: "deadlock: ..."
        return pipeline_sim.message_plan(f_and_b, p, m, 1, rank, as_written=True)


class _WithoutW:
    """A schedule's pp with its W calls dropped (they send nothing)."""

    def __init__(self, pp):
        self._pp = pp

    def backward_weight(self, s, i):
        pass

    def __getattr__(self, name):
        return getattr(self._pp, name)


def data(m):
    """The batch: ROWS samples per micro-batch of chapter 5's toy regression."""
    return models.toy_regression(ROWS * m, MODEL_KW["d_in"], MODEL_KW["d_out"], seed=1)
