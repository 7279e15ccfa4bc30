"""Checks of assignment 5: ZeRO-2 with gradients reduce-scattered in buckets during backward.

    import labsupport.grading.zero2_overlap as gz
    gz.check_parity(Zero2Overlap)          # = single-process AdamW after K steps, N = 2 and 4
    gz.check_reduce_scatter(Zero2Overlap)  # one reduce-scatter per bucket, no all-reduce
    gz.check_overlap(Zero2Overlap)         # each issued during backward, asynchronously
    gz.check_memory(Zero2Overlap)          # gradient memory: two buckets at most, shards after

The student's class is ``Zero2Overlap(model, bucket_numel, **adamw)`` with
``finish()`` (after backward: wait, keep the mean gradient shards) and
``step()``; its ``buckets`` each have ``params``, ``data``, ``numel``,
``shard_numel``, ``param_shard`` and ``grad``. Every check runs it on the
ranks through ``labsupport.grading.run``, so a deadlock ends at the
grading deadline with an AssertionError saying where each rank was stuck.
The calls are those of ``labsupport.calls``. The gradient memory is what
the student's code holds BY REFERENCE (``GradientRefs``), counted at fixed
points of the step (before and after the student's hook for each gradient,
and once ``finish()`` returned): the distinct storages reachable from the
student's object, its hooks and every parameter's ``.grad``
(``labsupport.checking.held``), plus the tensors of its asynchronous
collectives not yet waited for, less those reachable just before backward
(parameters, buffers, optimizer state). Python's references change only as
the rank's own code runs, so the count is the same on an idle machine and a
loaded one: when gloo's worker thread lets go of a finished work's tensors (a
moment after ``wait()`` returns) does not enter it.
ZeRO: Rajbhandari et al. 2020 (arXiv 1910.02054), §5.2 (P_g: "we use a
bucketization strategy", each bucket reduced to its partition's owner); the
per-bucket reduce-scatter graded here is FSDP's and Megatron-LM's distributed
optimizer's layout (every rank owns a shard of every bucket).
"""
import inspect

import torch
import torch.distributed as dist

from labsupport import _patch, calls, models
from labsupport.checking import collective_checks, held
from labsupport.memory import tally

CFG = models.GPTConfig(vocab_size=37, seq_len=8, hidden=15, heads=3, layers=2)  # Ψ odd
STEPS, BATCH = 3, 8
ADAMW = dict(lr=1e-2, weight_decay=0.1)
TOL = dict(rtol=1e-9, atol=1e-9)  # fp64: another order of additions, magnified by Adam
IN_FLIGHT = 2  # buckets whose full gradient may be alive at once: one reduced, one filling


def new_model():
    return models.GPT(CFG, seed=0).double()


def batch(step):
    ids, targets = models.toy_tokens(STEPS * BATCH, CFG.seq_len, CFG.vocab_size, seed=1)
    return ids[step * BATCH:(step + 1) * BATCH], targets[step * BATCH:(step + 1) * BATCH]


def reference(steps=STEPS) -> list:
    """AdamW in one process on the full batch: the parameters after ``steps`` steps."""
    model = new_model()
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    for step in range(steps):
        model(*batch(step)).backward()
        optimizer.step()
        optimizer.zero_grad()
    return [p.detach() for p in model.parameters()]


class _InFlight:
    """The tensors of this rank's asynchronous collectives not waited for yet: in use by
    the collective, whether or not the student's code still names them. A work leaves
    when ``wait()`` returns or ``is_completed()`` says True, in the rank's own order."""

    def __init__(self):
        self.tensors: dict[int, list] = {}   # id of the work -> its tensor arguments

    def wrappers(self) -> dict:
        return {name: self._wrap(name, _patch.current(name))
                for name in calls.COLLECTIVES}

    def _wrap(self, name, fn):
        signature = inspect.signature(fn)

        def tracked(*args, **kwargs):
            work = fn(*args, **kwargs)
            if work is None or not hasattr(work, "wait"):
                return work                  # blocking: done when it returned
            bound = signature.bind(*args, **kwargs).arguments.values()
            tensors = [t for v in bound
                       for t in (v if isinstance(v, (list, tuple)) else [v])
                       if isinstance(t, torch.Tensor)]
            return _TrackedWork(work, self, tensors)
        tracked.__wrapped__, tracked.__name__ = fn, fn.__name__
        return tracked


class _TrackedWork:
    """A collective's work as the student sees it; ``wait()`` marks it done."""

    def __init__(self, work, in_flight, tensors):
        self._work, self._in_flight = work, in_flight
        in_flight.tensors[id(self)] = tensors

    def wait(self, *args, **kwargs):
        result = self._work.wait(*args, **kwargs)
        self._in_flight.tensors.pop(id(self), None)
        return result

    def is_completed(self):
        done = self._work.is_completed()
        if done:
            self._in_flight.tensors.pop(id(self), None)
        return done

    def get_future(self):
        return _TrackedFuture(self._work.get_future(), self._in_flight, id(self))

    def __getattr__(self, name):  # exception(), result(), ...
        return getattr(self._work, name)


class _TrackedFuture:
    """A tracked work's future: waited for, or seen done, its work is no longer in flight."""

    def __init__(self, future, in_flight, key):
        self._future, self._in_flight, self._key = future, in_flight, key

    def _seen(self, result):
        self._in_flight.tensors.pop(self._key, None)
        return result

    def wait(self):
        return self._seen(self._future.wait())

    def value(self):
        return self._seen(self._future.value())

    def done(self):
        return self._seen(True) if self._future.done() else False

    def __getattr__(self, name):  # then(), add_done_callback(), ...
        return getattr(self._future, name)


class GradientRefs:
    """Bytes of gradient data the student's code holds by reference on this rank.

    ``count()`` walks (``held.reachable``) from the student's object and its
    class, the hooks on the parameters, every parameter's ``.grad`` and the
    tensors of the collectives in flight, and adds up the distinct storages it
    reaches that are gradient data: first reached by ``count()`` (during
    backward or after ``finish()``), not by ``snapshot()`` (just before
    backward: parameters, buffers, optimizer state). When a storage is freed
    never enters the count, only whether the student's code still reaches it.
    """

    def __init__(self, zero, params, in_flight):
        self.zero, self.params, self.in_flight = zero, params, in_flight
        self.held = held.Held(skip=(self,))
        self.peak, self.most_grads = 0, 0

    def _roots(self) -> list:
        roots = [self.zero, type(self.zero).__dict__,
                 list(self.in_flight.tensors.values())]
        for p in self.params:
            roots += [p, p.grad, list(p._post_accumulate_grad_hooks.values())]
        return roots

    def snapshot(self):
        """Before backward: what is reachable now and not yet gradient data is not."""
        self.held.snapshot(self._roots())

    def count(self) -> int:
        """Bytes of gradient data reachable now."""
        return self.held.count(self._roots())

    def before_hook(self, param):  # registered before the student's hook: runs first
        self.peak = max(self.peak, self.count())

    def after_hook(self, param):   # registered after it
        self.peak = max(self.peak, self.count())
        grads = sum(p.grad is not None for p in self.params)
        self.most_grads = max(self.most_grads, grads)

    def restart_peak(self) -> int:
        peak, self.peak = self.peak, 0
        return peak


def _train(cls, bucket_numel, steps) -> dict:
    """On each rank: ``steps`` steps of the student's class, recorded."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = new_model()
    params = list(model.parameters())
    in_flight = _InFlight()
    grads = GradientRefs(None, params, in_flight)
    for p in params:
        p.register_post_accumulate_grad_hook(grads.before_hook)
    with _patch.patched(in_flight.wrappers()):
        grads.zero = zero = cls(model, bucket_numel, **ADAMW)
        for p in params:  # the student's hooks run between the two
            p.register_post_accumulate_grad_hook(grads.after_hook)
        backward_peaks, left = [], []   # the most of any step: each must stay within
        with calls.record() as log:
            for step in range(steps):
                start = len(log.calls)            # the last step's calls are returned
                ids, targets = (models.shard(t, rank, world_size) for t in batch(step))
                loss = model(ids, targets)
                grads.snapshot()                  # optimizer state, made by step()
                loss.backward()
                backward_peaks.append(grads.restart_peak())
                zero.finish()
                left.append(grads.count())
                after = _after_finish(zero, params)
                zero.step()
    buckets = [dict(numel=b.numel, padded=b.data.numel(), shard=b.shard_numel)
               for b in zero.buckets]
    return dict(params=[p.detach().clone() for p in params], calls=log.calls[start:],
                peak_grad_bytes=max(backward_peaks), most_grads=grads.most_grads,
                after=dict(after, held=max(left)), buckets=buckets,
                steps=list(zip(backward_peaks, left)),
                max_param_bytes=max(p.numel() for p in params) * 8)


def _after_finish(zero, params) -> dict:
    """What the rank still holds once finish() returned."""
    return dict(param_grads=[tuple(p.shape) for p in params if p.grad is not None],
                bucket_grads=[i for i, b in enumerate(zero.buckets)
                              if getattr(b, "grad", None) is not None],
                shard_grads=[tally.storage_bytes([b.param_shard.grad]) for b in zero.buckets])


def _runs(cls, world_sizes, bucket_numel, timeout):
    return {n: [c["value"] for c in collective_checks.run(_train, cls, bucket_numel, STEPS,
                                                world_size=n, timeout=timeout)]
            for n in world_sizes}


def check_parity(cls, world_sizes=(2, 4), bucket_numel=1000, *, timeout=None):
    """After K steps every rank's parameters equal single-process AdamW on the full batch."""
    want = reference()
    names = [n for n, _ in new_model().named_parameters()]
    for n, ranks in _runs(cls, world_sizes, bucket_numel, timeout).items():
        for rank, run in enumerate(ranks):
            for name, got, expected in zip(names, run["params"], want):
                if not torch.allclose(got, expected, **TOL):
                    raise AssertionError(
                        f"{cls.__name__} with buckets of {bucket_numel} elements on {n} "
                        f"ranks: after {STEPS} steps, rank {rank}'s {name} differs from "
                        f"AdamW in one process by up to {(got - expected).abs().max():.3g}. "
                        "Each rank must step its shard of every bucket with the MEAN over "
                        "ranks of that shard's gradient (reduce-scatter sums: divide by "
                        "world_size), and all-gather the parameters after the step.")


def check_reduce_scatter(cls, world_sizes=(2, 4), bucket_numel=1000, *, timeout=None):
    """Per step and rank: one reduce-scatter per bucket, of the padded bucket, nothing else."""
    for n, ranks in _runs(cls, world_sizes, bucket_numel, timeout).items():
        for rank, run in enumerate(ranks):
            grads = _gradient_calls(run)
            names = sorted({c["op"] for c in grads})
            if any(not name.startswith("reduce_scatter") for name in names):
                raise AssertionError(
                    f"rank {rank} of {n} used {', '.join(names)} for the gradients. ZeRO-2 "
                    "reduce-scatters them: an all-reduce sends the same bytes but leaves every "
                    "rank the whole mean gradient, which ZeRO-2 does not keep; use "
                    "dist.reduce_scatter_single(shard, bucket_grad, async_op=True).")
            _assert_one_per_bucket(grads, run["buckets"], rank, n)


def _assert_one_per_bucket(calls, buckets, rank, n):
    want = [(b["padded"], b["shard"]) for b in buckets]
    got = [tuple(reversed(c["sizes"])) for c in calls]   # (input, output)
    if sorted(got) != sorted(want):
        raise AssertionError(
            f"rank {rank} of {n}: one step made {len(got)} reduce-scatter(s) of "
            f"(input, output) elements {got}; expected one per bucket, {want}: the padded "
            "bucket in, this rank's shard of it out. Each rank then sends (N-1)/N of the "
            "padded parameter count per step, as the ZeRO paper counts.")


def check_overlap(cls, world_sizes=(2,), bucket_numel=1000, *, timeout=None):
    """Every bucket's reduce-scatter is issued during backward, asynchronously."""
    for n, ranks in _runs(cls, world_sizes, bucket_numel, timeout).items():
        for rank, run in enumerate(ranks):
            grads = _gradient_calls(run)
            late = [c["op"] for c in grads if not c["in_backward"]]
            blocking = [c["op"] for c in grads if not c["async_op"]]
            if late or blocking or len(grads) < len(run["buckets"]):
                raise AssertionError(
                    f"rank {rank} of {n}: of {len(run['buckets'])} buckets' gradient "
                    f"collectives, {len(grads) - len(late)} were issued during backward, "
                    f"{len(blocking)} of all were blocking. Issue each bucket's reduce-scatter "
                    "from the gradient hook as soon as its last gradient arrives, with "
                    "async_op=True, and wait for the works in finish(): then the network "
                    "works while backward computes the earlier layers.")


def _gradient_calls(run) -> list:
    """The step's collectives on gradients: all but step()'s parameter all-gathers."""
    return [c for c in run["calls"] if c["kind"] == "collective"
            and (not c["op"].startswith("all_gather") or c["in_backward"])]


def check_memory(cls, world_sizes=(2,), bucket_numel=1000, *, timeout=None):
    """Gradient memory during backward: at most IN_FLIGHT buckets' full gradients, one
    parameter's .grad and this rank's shards; after finish(), the shards only."""
    for n, ranks in _runs(cls, world_sizes, bucket_numel, timeout).items():
        for rank, run in enumerate(ranks):
            _assert_freed_after_finish(run, rank, n)
            _assert_backward_peak(run, rank, n)


def _assert_freed_after_finish(run, rank, n):
    after, shards = run["after"], [8 * b["shard"] for b in run["buckets"]]
    if after["param_grads"] or after["bucket_grads"]:
        raise AssertionError(
            f"rank {rank} of {n}: after finish(), {len(after['param_grads'])} "
            f"parameters still hold a .grad and buckets {after['bucket_grads']} "
            "their full gradient buffer. ZeRO-2 keeps only this rank's shard: set "
            "param.grad = None once it is copied into its bucket, and bucket.grad = "
            "None once its reduce-scatter has finished.")
    if after["shard_grads"] != shards:
        raise AssertionError(
            f"rank {rank} of {n}: after finish(), the gradient shards hold "
            f"{after['shard_grads']} bytes (their whole storage, counted by "
            f"tally.storage_bytes); expected {shards}: bucket.param_shard.grad "
            "must be a tensor of its own, the mean of this rank's shard only (a "
            "view into the full bucket keeps the whole bucket alive).")
    if after["held"] > sum(shards):
        raise AssertionError(
            f"rank {rank} of {n}: after finish(), your code still reaches "
            f"{after['held']:,} bytes of gradient data, more than this rank's shards "
            f"({sum(shards):,} bytes): "
            "something still holds a full gradient buffer (a list or a dict of them, a "
            "copy): free every buffer once its reduce-scatter is done.")


def _assert_backward_peak(run, rank, n):
    buckets = run["buckets"]
    biggest = sorted(8 * b["padded"] for b in buckets)[-IN_FLIGHT:]
    bound = sum(biggest) + run["max_param_bytes"] + sum(8 * b["shard"] for b in buckets)
    if run["peak_grad_bytes"] <= bound:
        return
    head = (f"rank {rank} of {n}: during backward, gradient data took up to "
            f"{run['peak_grad_bytes']:,} bytes (every .grad, bucket buffer and shard your "
            "code held at once, counted by reference), more than "
            f"{min(IN_FLIGHT, len(buckets))} buckets, one parameter's .grad and this rank's "
            f"shards ({bound:,} bytes). ")
    if run["most_grads"] > 1:
        raise AssertionError(head + f"Up to {run['most_grads']} parameters held a .grad at "
                             "once: free each .grad in the hook, as soon as it is copied "
                             "into its bucket, not at the end of backward.")
    raise AssertionError(head + "Each bucket's full buffer must go once its reduce-scatter "
                         "is done, not in finish(): when a bucket is complete, wait for the "
                         "previous bucket's work, keep its mean shard and set that bucket's "
                         "grad = None, then start this bucket's reduce-scatter.")
