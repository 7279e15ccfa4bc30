"""Chapter 10's sharded checkpoint: every rank writes its own shards, any world size reads them.

    pieces = zero3_pieces(model, optimizer)          # on every rank of a Zero3 model
    save_sharded(f"{root}/step000004", pieces, extra, layout=unit_layout(model))
    tensors, nbytes = load_resharded(path, zero3_wanted(model))   # at another N
    zero3_restore(model, optimizer, tensors, step)
    latest_checkpoint(root)                          # the newest complete one, or None

A checkpoint is a directory: ``rank<r>.bin`` (rank r's raw bytes, no header),
``extra.pt`` (each rank's small state: step, data position, RNG) and
``metadata.json``, which says which global slice of which flat tensor each
file holds, at which byte offset. Loading at another world size reads, for
each new slice, the overlapping parts of the saved ones by offset, and no
more. The files are written into ``<dir>.tmp`` and renamed once every rank
is done (POSIX rename is atomic; the directories are fsynced before and after it,
so that it is durable too), so a checkpoint is complete or absent; a
``.tmp`` directory or a file of the wrong size is refused with
``IncompleteCheckpoint``. The functions between the lesson markers are the
chapter's (notebooks/10_checkpoints_and_failures.ipynb), kept identical by
tests/test_sharded_checkpoint.py.
"""
import json
import os
import pickle
import shutil

import torch
import torch.distributed as dist


class IncompleteCheckpoint(ValueError):
    """A checkpoint directory that was not completely written (or was damaged since)."""


# --- lesson: notebooks/10_checkpoints_and_failures.ipynb (the notebook's copy must match) ---
def save_sharded(directory, pieces, extra=None, layout=None):
    """Every rank writes its own pieces; rank 0 the metadata, then renames.

    ``pieces``: {name: (tensor, start, numel)}: this rank holds elements
    [start, start + tensor.numel()) of the flat tensor ``name`` of
    ``numel`` elements. ``extra``: this rank's small state; ``layout``:
    what the flat tensors hold (names and shapes), for readers.
    """
    rank, tmp = dist.get_rank(), directory + ".tmp"
    if os.path.exists(directory):            # checked on every rank alike
        raise FileExistsError(f"{directory} exists: save each step once")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)       # an interrupted save
        os.makedirs(tmp)
    dist.barrier()
    index = write_pieces(os.path.join(tmp, f"rank{rank}.bin"), pieces)
    gathered = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object((index, extra), gathered, dst=0)
    if rank == 0:
        write_metadata(tmp, [i for i, _ in gathered], layout)
        with open(os.path.join(tmp, "extra.pt"), "wb") as f:
            torch.save([e for _, e in gathered], f)
            f.flush()
            os.fsync(f.fileno())
        fsync_directory(tmp)              # the files' names on disk too
        os.rename(tmp, directory)         # atomic: complete or absent
        fsync_directory(os.path.dirname(os.path.abspath(directory)))
    dist.barrier()                        # durable: the rename is on disk


def write_pieces(path, pieces):
    """Raw bytes of each piece, one after the other; {name: where}."""
    index, offset = {}, 0
    with open(path, "wb") as f:
        for name, (tensor, start, numel) in pieces.items():
            data = tensor.detach().cpu().reshape(-1).view(torch.uint8)
            f.write(data.numpy().tobytes())
            index[name] = dict(file=os.path.basename(path), offset=offset,
                               start=start, length=tensor.numel(),
                               numel=numel,
                               dtype=str(tensor.dtype).removeprefix("torch."))
            offset += data.numel()
        f.flush()
        os.fsync(f.fileno())             # on disk before the rename
    return index


def write_metadata(tmp, indexes, layout):
    """Which slice of which flat tensor each rank's file holds, and where."""
    tensors = {}
    for index in indexes:                             # rank order
        for name, piece in index.items():
            entry = tensors.setdefault(name, dict(
                numel=piece["numel"], dtype=piece["dtype"], pieces=[]))
            entry["pieces"].append({k: piece[k] for k in (
                "file", "offset", "start", "length")})
    files = {f"rank{r}.bin": os.path.getsize(os.path.join(tmp, f"rank{r}.bin"))
             for r in range(len(indexes))}
    meta = dict(world_size=len(indexes), files=files, tensors=tensors,
                layout=layout)
    with open(os.path.join(tmp, METADATA), "w") as f:
        json.dump(meta, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def fsync_directory(path):
    """Make the names in a directory durable (fsync on the directory).

    A file's fsync writes its bytes; its name, and a rename, live in the
    directory, which needs an fsync of its own (POSIX fsync; Linux fsync(2)).
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


METADATA = "metadata.json"


def zero3_pieces(model, optimizer):
    """A Zero3 rank's pieces: each unit's parameters, AdamW's m and v."""
    rank, pieces = dist.get_rank(), {}
    for i, (flat, shard) in enumerate(zip(model.flats, model.shards)):
        start = rank * flat.shard_numel
        real = max(0, min(flat.shard_numel, flat.numel - start))  # no pad
        state = optimizer.state[shard]
        for kind, tensor in (("param", shard), ("exp_avg", state["exp_avg"]),
                             ("exp_avg_sq", state["exp_avg_sq"])):
            pieces[f"unit{i}.{kind}"] = (tensor[:real], start, flat.numel)
    return pieces


def read_metadata(directory):
    """The metadata of a complete checkpoint; IncompleteCheckpoint if not."""
    path = os.path.join(directory, METADATA)
    if directory.rstrip("/").endswith(".tmp") or not os.path.exists(path):
        raise IncompleteCheckpoint(
            f"{directory} is not a complete checkpoint (no {METADATA}: "
            "its save was interrupted): load the latest complete one, "
            "latest_checkpoint(root)")
    with open(path) as f:
        meta = json.load(f)
    for name, size in meta["files"].items():
        file = os.path.join(directory, name)
        found = os.path.getsize(file) if os.path.exists(file) else None
        if found != size:
            raise IncompleteCheckpoint(
                f"{file}: {found} bytes on disk, the metadata says {size}: "
                "this checkpoint is damaged; load an earlier one")
    return meta


def read_plan(pieces, start, length, itemsize):
    """(file, byte offset, count, position) of each overlapping piece."""
    plan = []
    for piece in pieces:
        lo = max(start, piece["start"])                  # the overlap:
        hi = min(start + length, piece["start"] + piece["length"])
        if lo < hi:
            offset = piece["offset"] + (lo - piece["start"]) * itemsize
            plan.append((piece["file"], offset, hi - lo, lo - start))
    return plan


def load_resharded(directory, wanted):
    """Elements [start, start + length) of each flat tensor, by offset.

    ``wanted``: {name: (start, length)}, at any world size. Only the
    overlapping parts of the saved pieces are read; elements past the
    tensor's end (padding) are zero. Returns ({name: tensor}, bytes read).
    """
    meta, out, nbytes = read_metadata(directory), {}, 0
    for name, (start, length) in wanted.items():
        info = meta["tensors"][name]
        out[name] = torch.zeros(length, dtype=getattr(torch, info["dtype"]))
        size = out[name].element_size()
        plan = read_plan(info["pieces"], start, length, size)  # your turn's
        for file, offset, count, position in plan:
            with open(os.path.join(directory, file), "rb") as f:
                f.seek(offset)
                data = bytearray(f.read(count * size))
            out[name][position:position + count] = torch.frombuffer(
                data, dtype=out[name].dtype)
            nbytes += len(data)
    return out, nbytes


def zero3_wanted(model):
    """What this rank of a Zero3 model loads: its padded shard of each."""
    rank = dist.get_rank()
    return {f"unit{i}.{kind}": (rank * flat.shard_numel, flat.shard_numel)
            for i, flat in enumerate(model.flats)
            for kind in ("param", "exp_avg", "exp_avg_sq")}


def zero3_restore(model, optimizer, tensors, step):
    """Put the loaded shards into the model and AdamW's state (at ``step``)."""
    for i, shard in enumerate(model.shards):
        with torch.no_grad():
            shard.copy_(tensors[f"unit{i}.param"])
        optimizer.state[shard] = dict(
            step=torch.tensor(float(step)),
            exp_avg=tensors[f"unit{i}.exp_avg"].clone(),
            exp_avg_sq=tensors[f"unit{i}.exp_avg_sq"].clone())


def latest_checkpoint(root):
    """The newest complete checkpoint under ``root`` (None if there is none)."""
    names = sorted(n for n in os.listdir(root) if n.startswith("step")
                   and not n.endswith(".tmp")) if os.path.isdir(root) else []
    for name in reversed(names):
        if os.path.exists(os.path.join(root, name, METADATA)):
            return os.path.join(root, name)
    return None
# --- end of lesson ---


def unit_layout(model) -> dict:
    """{"unit<i>": [[name, shape], ...]}: each flat unit's parameters, in order (a Zero3)."""
    names = {p: n for n, p in model.module.named_parameters()}
    # flat.shapes: between steps a Zero3 parameter is its 1-D piece of the shard
    return {f"unit{i}": [[names[p], list(shape)] for p, shape in zip(flat.params, flat.shapes)]
            for i, flat in enumerate(model.flats)}


def read_extra(directory) -> list:
    """Each saving rank's ``extra``, by rank (tensors, numbers, strings and containers only)."""
    read_metadata(directory)
    try:
        return torch.load(os.path.join(directory, "extra.pt"), weights_only=True)
    except pickle.UnpicklingError as exc:
        raise ValueError(
            f"{directory}/extra.pt holds an object torch.load(weights_only=True) refuses "
            f"({str(exc).splitlines()[0]}...): save plain state (tensors, numbers, strings, "
            "lists, dicts), e.g. loader.position rather than the loader") from None


def full_state(directory) -> dict:
    """The whole checkpoint in one process, in torch's layout: {"model": {name: tensor},
    "optim": {name: {"exp_avg", "exp_avg_sq"}}} (unflattened with the saved layout)."""
    meta = read_metadata(directory)
    if not meta.get("layout"):
        raise ValueError(f"{directory} records no layout: save it with layout=unit_layout(model)")
    wanted = {name: (0, info["numel"]) for name, info in meta["tensors"].items()}
    flat, _ = load_resharded(directory, wanted)
    model, optim = {}, {}
    for unit, params in meta["layout"].items():
        offset = 0
        for name, shape in params:
            numel = int(torch.Size(shape).numel())
            view = {k: flat[f"{unit}.{k}"][offset:offset + numel].view(shape)
                    for k in ("param", "exp_avg", "exp_avg_sq")}
            model[name] = view["param"]
            optim[name] = {k: view[k] for k in ("exp_avg", "exp_avg_sq")}
            offset += numel
    return {"model": model, "optim": optim}


def file_bytes(directory) -> dict:
    """{file name: bytes} of every file of a checkpoint directory (ours or DCP's)."""
    return {name: os.path.getsize(os.path.join(directory, name))
            for name in sorted(os.listdir(directory))}
