"""The capstone's training state, saved at one layout and resumed at another, with DCP.

    save(f"{root}/step000050", stage, opt, meta)    # on every rank of one layout
    step = load(latest(root), stage, opt, loader, meta)   # on every rank of another
    whole = full_state(path)                        # in one process: whole tensors

The state of a capstone run is the decoder's parameters, AdamW's moments
(``exp_avg``, ``exp_avg_sq``) and step count, and the loader's position (the
number of global batches taken, ``capstone.data.Loader.state_dict``). The
data position means the same at any dp, so it carries over a change of
layout as it is; the tensors do not: a rank holds a TP chunk of some of them
(``Stage.shards``), only its pipeline stage's blocks, and the same pieces as
every other rank of its dp x cp group.

PyTorch's distributed checkpoint (``torch.distributed.checkpoint``, DCP;
https://docs.pytorch.org/docs/stable/distributed.checkpoint.html) stores
every tensor by its global name and shape, each rank's piece with its
offset, as chapter 10's own format does (``checkpoints.sharded_checkpoint``:
its metadata says which global slice each file holds). What a rank gives
DCP says where its piece sits:

- a TP chunk becomes a ``DTensor`` with ``Shard(dim)`` on a one-dimensional
  mesh of this rank's tp group (``DeviceMesh.from_group``: the layout's own
  group, no new one), so its global shape and offset are known;
- a tensor held whole (a LayerNorm, the position embedding, any parameter at
  tp = 1) is a plain tensor: DCP takes it as replicated;
- pipeline stages hold different parameters, named by their global block
  index (``blocks.3.attn.q.weight``), so their names do not collide;
- the pieces that dp x cp ranks hold alike are written once (DCP's save
  planner removes duplicate pieces across ranks, ``dedup_save_plans``).

Loading at another layout asks, on each rank, for that layout's pieces in
the same way, and DCP reads from the stored pieces the parts that overlap
them: chapter 10's ``load_resharded``, by PyTorch. Like chapter 10's saves,
a save is written into ``<dir>.tmp`` and renamed when every rank is done, so
a checkpoint directory is complete or absent (``latest`` skips the rest).
The run's sizes go with it (``meta``): a resume with another decoder, global
batch or sequence length is refused before any tensor is read.
"""
import dataclasses
import json
import os
import shutil
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from labsupport.checkpoints.sharded_checkpoint import fsync_directory

DCP_METADATA = ".metadata"     # DCP writes it last, on the coordinator rank
TRAIN_KEY = "train"            # the run's step, data position and sizes, as JSON


def _mesh(stage):
    """A one-dimensional DeviceMesh over this rank's tp group (cached on the stage)."""
    if getattr(stage, "_tp_mesh", None) is None:
        device = next(stage.parameters()).device.type
        stage._tp_mesh = DeviceMesh.from_group(stage.group, device)
    return stage._tp_mesh


def _global(tensor, shard, stage):
    """``tensor`` as DCP should see it: a DTensor if it is a TP chunk, else itself."""
    if shard is None:
        return tensor
    return DTensor.from_local(tensor, _mesh(stage), [Shard(shard[0])], run_check=False)


def init_optimizer_state(opt):
    """Give every parameter its optimizer state (AdamW's moments and step), so that
    a checkpoint can be loaded into it: one step with zero gradients and lr = 0, the
    way ``torch.distributed.checkpoint.state_dict`` does it (``_init_optim_state``).
    The parameters do not move (lr = 0, so no update and no weight decay)."""
    params = [p for g in opt.param_groups for p in g["params"]]
    if all(opt.state.get(p) for p in params):
        return
    lrs = [g["lr"] for g in opt.param_groups]
    grads = [p.grad for p in params]
    for g in opt.param_groups:
        g["lr"] = 0.0
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    for g, lr in zip(opt.param_groups, lrs):
        g["lr"] = lr
    for p, grad in zip(params, grads):
        p.grad = grad


def state_dict(stage, opt):
    """{name: tensor or DTensor}: this rank's parameters and optimizer state, by
    global name (``model.<param>``, ``optim.<param>.<exp_avg|exp_avg_sq|step>``)."""
    shards, out = stage.shards(), {}
    for name, p in stage.named_parameters():
        out[f"model.{name}"] = _global(p.detach(), shards[name], stage)
        for key, value in opt.state[p].items():
            same = torch.is_tensor(value) and value.shape == p.shape
            out[f"optim.{name}.{key}"] = _global(value, shards[name] if same else None,
                                                 stage)
    return out


def save(directory, stage, opt, meta):
    """Write this rank's state into the DCP checkpoint ``directory`` (on every rank).

    ``meta``: the run's step, loader state and sizes (JSON-able, the same on
    every rank), checked by ``load``. Written into ``directory.tmp``, renamed
    once every rank is done.
    """
    tmp, rank = directory + ".tmp", dist.get_rank()
    if os.path.exists(directory):          # checked on every rank alike
        raise FileExistsError(f"{directory} exists: save each step once")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)     # an interrupted save
        os.makedirs(tmp)
    dist.barrier()
    state = dict(state_dict(stage, opt), **{TRAIN_KEY: json.dumps(meta)})
    dcp.save(state, checkpoint_id=tmp)
    dist.barrier()                          # every rank's file written
    if rank == 0:
        fsync_directory(tmp)
        os.rename(tmp, directory)           # atomic: complete or absent
        fsync_directory(os.path.dirname(os.path.abspath(directory)))
    dist.barrier()


def read_meta(directory) -> dict:
    """The ``meta`` a checkpoint was saved with (any process, with or without ranks)."""
    if not os.path.exists(os.path.join(directory, DCP_METADATA)):
        raise FileNotFoundError(f"{directory} is not a complete DCP checkpoint "
                                f"(no {DCP_METADATA}): use latest(root)")
    state = {TRAIN_KEY: ""}
    _load(state, directory, collective=False)    # on one rank alone, too
    return json.loads(state[TRAIN_KEY])


def run_meta(cfg, layout, loader_state, optimizer, dtype) -> dict:
    """What a checkpoint of this run records besides its tensors (JSON):
    ``loader_state`` is ``capstone.data.Loader.state_dict()``."""
    name = optimizer if isinstance(optimizer, str) else getattr(
        optimizer, "__qualname__", type(optimizer).__qualname__)
    return dict(step=0, layout=list(layout), loader=dict(loader_state),
                config=dataclasses.asdict(cfg), optimizer=name,
                dtype=str(dtype).removeprefix("torch."))


def check_meta(saved, mine, directory):
    """Refuse to resume a run whose global batch, decoder, optimizer or dtype
    differ from the saved one's, saying which."""
    pairs = [(k, saved["loader"].get(k), v) for k, v in mine["loader"].items()
             if k != "step"]
    pairs += [(k, saved["config"].get(k), v) for k, v in mine["config"].items()]
    pairs += [(k, saved.get(k), mine[k]) for k in ("optimizer", "dtype")]
    # once each (seq_len is both the loader's and the decoder's)
    diffs = list(dict.fromkeys(f"{k}={a} saved, {b} here" for k, a, b in pairs
                               if a != b))
    if diffs:
        raise ValueError(f"cannot resume from {directory}: " + "; ".join(diffs)
                         + ". The layout may change; the global batch (sequences, "
                         "bytes, data seed), the decoder's sizes, the optimizer and "
                         "the dtype may not")


def resume(directory, stage, opt, loader, meta, steps) -> int:
    """The step to start from: 0 without ``directory``, else ``load``'s."""
    if directory is None:
        return 0
    first = load(directory, stage, opt, loader, meta)
    if first >= steps:
        raise ValueError(f"{directory} is at step {first}: steps={steps} leaves "
                         "nothing to train (steps counts from the run's start)")
    return first


def load(directory, stage, opt, loader, meta):
    """Load a checkpoint written at any layout into this rank's stage, optimizer
    and loader (on every rank); returns the step to continue from.

    ``meta``: this run's, as ``save`` takes it (its sizes must be the saved ones).
    """
    saved = read_meta(directory)
    check_meta(saved, meta, directory)
    loader.load_state_dict(saved["loader"])        # the data position
    init_optimizer_state(opt)
    state = state_dict(stage, opt)
    _load(state, directory)
    with torch.no_grad():
        for name, p in stage.named_parameters():
            # a DTensor's local piece may be a copy of the buffer it was made from
            _copy(p, state[f"model.{name}"])
            for key, value in opt.state[p].items():
                _copy(value, state[f"optim.{name}.{key}"])
    return int(saved["step"])


def _copy(dst, src):
    src = src.to_local() if isinstance(src, DTensor) else src
    if src.data_ptr() != dst.data_ptr():
        dst.copy_(src)


def _load(state, directory, collective=True):
    """``dcp.load``: collective over the ranks, or (``collective=False``, or
    without a process group) by this process alone, which then reads every
    tensor it asks for whole (DCP warns that it assumes so)."""
    if collective and dist.is_initialized():
        dcp.load(state, checkpoint_id=directory)
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.load(state, checkpoint_id=directory, no_dist=True)


def latest(root):
    """The newest complete checkpoint ``root/step<NNNNNN>`` (None if there is none)."""
    if not root or not os.path.isdir(root):
        return None
    names = sorted(n for n in os.listdir(root)
                   if n.startswith("step") and not n.endswith(".tmp"))
    for name in reversed(names):
        if os.path.exists(os.path.join(root, name, DCP_METADATA)):
            return os.path.join(root, name)
    return None


def path_for(root, step):
    """Where the checkpoint after ``step`` steps goes."""
    return os.path.join(root, f"step{step:06d}")


def full_state(directory) -> dict:
    """The whole checkpoint in one process (no ranks): {"model": {name: tensor},
    "optim": {name: {key: tensor}}, "meta": meta}, whatever layout saved it."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = dcp.FileSystemReader(directory).read_metadata()
    state = {k: torch.empty(v.size, dtype=v.properties.dtype)
             for k, v in md.state_dict_metadata.items()
             if isinstance(v, TensorStorageMetadata)}
    _load(state, directory, collective=False)
    model = {k.removeprefix("model."): v for k, v in state.items()
             if k.startswith("model.")}
    optim = {}
    for k, v in state.items():
        if k.startswith("optim."):
            name, key = k.removeprefix("optim.").rsplit(".", 1)
            optim.setdefault(name, {})[key] = v
    return {"model": model, "optim": optim, "meta": read_meta(directory)}

