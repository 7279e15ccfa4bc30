"""Checks of graded assignment 8: a ZeRO-3 checkpoint loaded as tensor-parallel shards.

    import labsupport.grading.reshard_to_tensor_parallel as gr
    gr.check_column(load_tp_shard)       # q, k, v, fc1: rows (and bias) split over tp
    gr.check_row(load_tp_shard)          # o, fc2: columns split over tp
    gr.check_replicated(load_tp_shard)   # LayerNorms, embeddings, o's and fc2's biases
    gr.check_bytes(load_tp_shard)        # each rank read its shards' bytes, returned them

The checkpoints are chapter 10's (``labsupport.checkpoints.sharded_checkpoint``): the
shared decoder trained with chapter 7's ZeRO-3, saved by ``SAVED_BY`` ranks
(each unit's parameters and AdamW moments as flat tensors, cut in equal
slices regardless of the parameters' boundaries). The student writes
``load_tp_shard(reader, kind, tp_rank, tp_size)``: for ``kind`` in
``KINDS``, {parameter name: this tp rank's shard} in chapter 4's layout
(Shoeybi et al. 2019, §3, for the attention and MLP matrices: ``SPLIT``; the tied
embedding stays whole, where Megatron splits it by vocabulary), reading only through
``reader.read(file, offset, nbytes)``, which counts the bytes. Each check
runs it on ``TP`` ranks through ``labsupport.grading.run`` (a deadlock fails
at the deadline with where each rank was) and compares with the
checkpoint's whole state cut in one process.
"""
import atexit
import collections
import math
import os
import shutil
import tempfile

import torch

from labsupport.checking import collective_checks
from labsupport.checkpoints import resumable
from labsupport.checkpoints import sharded_checkpoint as sc
from labsupport.launch import session

TP = 4                                    # the tensor-parallel ranks that load
SAVED_BY = (2, 3)                         # the ZeRO-3 checkpoints, by saving world size
KINDS = ("param", "exp_avg", "exp_avg_sq")
RECIPE = resumable.Recipe(vocab_size=37, seq_len=8, hidden=16, heads=4, layers=2,
                          data_size=12, batch=6)
# The dim each tensor-parallel shard splits (chapter 4): column-parallel q, k, v and fc1
# (their output rows and biases), row-parallel o and fc2 (their input columns); every
# other parameter, o's and fc2's biases included, is whole on every rank.
SPLIT = {"attn.q.weight": 0, "attn.q.bias": 0, "attn.k.weight": 0, "attn.k.bias": 0,
         "attn.v.weight": 0, "attn.v.bias": 0, "mlp.fc1.weight": 0, "mlp.fc1.bias": 0,
         "attn.o.weight": 1, "mlp.fc2.weight": 1}


def split_dim(name: str):
    """The dim along which parameter ``name`` is split over tp (None: replicated)."""
    return next((dim for suffix, dim in SPLIT.items() if name.endswith("." + suffix)), None)


class Reader:
    """A checkpoint the student reads: ``metadata`` (its metadata.json) and ``read``."""

    def __init__(self, directory: str):
        self.directory = directory
        self.metadata = sc.read_metadata(directory)
        self.bytes_read, self.reads = 0, []     # reads: (file, offset, nbytes)

    def read(self, file: str, offset: int, nbytes: int) -> bytes:
        """``nbytes`` bytes of ``file`` from byte ``offset``, counted."""
        size = self.metadata["files"].get(file)
        if size is None:
            raise ValueError(f"no file {file!r} in this checkpoint: the files are "
                             f"{sorted(self.metadata['files'])}")
        if not (0 <= offset and 0 <= nbytes and offset + nbytes <= size):
            raise ValueError(f"read({file!r}, {offset}, {nbytes}) goes outside the file's "
                             f"{size} bytes: offsets are in bytes, counts in bytes too")
        with open(os.path.join(self.directory, file), "rb") as f:
            f.seek(offset)
            data = f.read(nbytes)
        self.bytes_read += len(data)
        self.reads.append((file, offset, len(data)))
        return data


_saved: dict = {}


def checkpoints() -> dict:
    """{saving world size: checkpoint directory}, made once per process (removed at exit)."""
    if not _saved:
        root = tempfile.mkdtemp(prefix="labsupport-reshard-")
        atexit.register(shutil.rmtree, root, True)
        for n in SAVED_BY:
            path = os.path.join(root, f"saved-by-{n}")
            # gloo even on GPUs, as every grader's group (checking.diagnosis.run)
            session.group_for(n, backend="gloo").run(
                resumable.train, RECIPE, path, 2, 2, resumable.training_state,
                resumable.restore_training_state)
            _saved[n] = sc.latest_checkpoint(path)
    return _saved


def expected(directory, tp_rank) -> dict:
    """{kind: {name: tp_rank's shard}} cut from the checkpoint's whole state."""
    full, out = sc.full_state(directory), {}
    for kind in KINDS:
        source = full["model"] if kind == "param" else {
            name: moments[kind] for name, moments in full["optim"].items()}
        out[kind] = {name: t if split_dim(name) is None else
                     t.chunk(TP, split_dim(name))[tp_rank] for name, t in source.items()}
    return out


def load_on_tp_ranks(fn, reader):
    """On each of the TP ranks: fn's shards for every kind, and the bytes it read."""
    import torch.distributed as dist
    shards = {}
    reader.bytes_read, reader.reads = 0, []
    for kind in KINDS:
        shards[kind] = fn(reader, kind, dist.get_rank(), dist.get_world_size())
    return dict(shards=shards, bytes_read=reader.bytes_read, reads=reader.reads)


def _runs(fn, timeout):
    """(saving N, directory, [per tp rank: result]) for each checkpoint."""
    if not callable(fn):
        raise TypeError(f"pass your function, e.g. check_column(load_tp_shard); got {fn!r}")
    for n, directory in checkpoints().items():
        try:
            calls = collective_checks.run(load_on_tp_ranks, fn, Reader(directory), world_size=TP,
                                timeout=timeout)
        except AssertionError:
            session.current().restart()      # nothing left in flight for the next check
            raise
        yield n, directory, [c["value"] for c in calls]


def _check(fn, timeout, which):
    for n, directory, ranks in _runs(fn, timeout):
        meta = sc.read_metadata(directory)
        for tp_rank, got in enumerate(ranks):
            want = expected(directory, tp_rank)
            for kind in KINDS:
                for name, tensor in want[kind].items():
                    if which(split_dim(name)):
                        where = (f"checkpoint saved by {n} ranks, tp rank {tp_rank} of "
                                 f"{TP}, {kind} of {name}")
                        _compare(got["shards"], kind, name, tensor, where, meta, tp_rank)


def check_column(fn, *, timeout=None):
    """q, k, v and fc1: each tp rank's rows of the weight and of the bias, bitwise."""
    _check(fn, timeout, lambda dim: dim == 0)


def check_row(fn, *, timeout=None):
    """o and fc2: each tp rank's columns of the weight, bitwise."""
    _check(fn, timeout, lambda dim: dim == 1)


def check_replicated(fn, *, timeout=None):
    """Everything else, whole on every tp rank, bitwise."""
    _check(fn, timeout, lambda dim: dim is None)


def _compare(shards, kind, name, want, where, meta, tp_rank):
    mine = shards.get(kind) if isinstance(shards, dict) else None
    got = mine.get(name) if isinstance(mine, dict) else None
    if not isinstance(got, torch.Tensor):
        raise AssertionError(f"{where}: missing. Return {{name: tensor}} for every parameter "
                             "of the checkpoint's layout (metadata['layout']), for each kind")
    if tuple(got.shape) != tuple(want.shape):
        raise AssertionError(f"{where}: shape {tuple(got.shape)}, expected "
                             f"{tuple(want.shape)}" + _shape_hint(name, want.shape))
    if torch.equal(got, want):
        return
    hint = _wrong_element(got, want, name, kind, meta, tp_rank)
    raise AssertionError(f"{where}: the values differ from the checkpoint's: {hint}. The "
                         "flat tensor <unit>.<kind> holds the unit's parameters back to back "
                         "in the layout's order, each row-major; each saved piece covers its "
                         "elements [start, start + length) from byte `offset` of `file` (4 "
                         "bytes each), and a parameter can straddle two pieces")


def _shape_hint(name, shape) -> str:
    dim = split_dim(name)
    if dim is None:
        return ": this parameter is not split; every tp rank holds all of it"
    kind = "column" if dim == 0 else "row"
    return (f": it is {kind}-parallel, split along dim {dim} into {TP} equal parts"
            + (" (its input columns, not its rows)" if dim == 1 else ""))


def _locate(layout, name):
    """(unit, element offset in the unit's flat tensor, shape) of parameter ``name``."""
    for unit, params in layout.items():
        first = 0
        for param, shape in params:
            if param == name:
                return unit, first, shape
            first += math.prod(shape)
    raise KeyError(name)


def _wrong_element(got, want, name, kind, meta, tp_rank) -> str:
    index = [int(i) for i in (got != want).nonzero()[0]]
    whole = list(index)
    if split_dim(name) is not None:
        whole[split_dim(name)] += tp_rank * want.shape[split_dim(name)]
    unit, first, shape = _locate(meta["layout"], name)
    flat = first + sum(i * math.prod(shape[d + 1:]) for d, i in enumerate(whole))
    piece = next(p for p in meta["tensors"][f"{unit}.{kind}"]["pieces"]
                 if p["start"] <= flat < p["start"] + p["length"])
    return (f"element {tuple(index)} of the shard is {got[tuple(index)].item():.6g}, "
            f"expected {want[tuple(index)].item():.6g}: element {tuple(whole)} of the "
            f"parameter, element {flat} of the flat {unit}.{kind}, which {piece['file']} "
            f"holds at byte {piece['offset'] + (flat - piece['start']) * 4}")


def check_bytes(fn, *, timeout=None):
    """Each tp rank read exactly the bytes of its shards, for every kind: as many, and the
    values it returned are the ones it read (a count that only adds up fails)."""
    for n, directory, ranks in _runs(fn, timeout):
        meta = sc.read_metadata(directory)
        total = sum(meta["files"].values())
        for tp_rank, got in enumerate(ranks):
            need = sum(t.numel() * t.element_size()
                       for kind in expected(directory, tp_rank).values() for t in kind.values())
            where = f"checkpoint saved by {n} ranks: tp rank {tp_rank}"
            if got["bytes_read"] != need:
                raise AssertionError(
                    f"{where} read {got['bytes_read']:,} bytes through reader.read; its "
                    f"shards (3 kinds) are {need:,} bytes; the whole checkpoint is "
                    f"{total:,}. " + _bytes_hint(got["bytes_read"], need, total))
            _returned_what_it_read(directory, got, where)


def _returned_what_it_read(directory, got, where):
    """The values returned are the 4-byte words read (as a multiset), so that a count of
    bytes that only adds up (values taken from elsewhere) does not pass."""
    read = collections.Counter()
    for file, offset, nbytes in got["reads"]:
        with open(os.path.join(directory, file), "rb") as f:
            f.seek(offset)
            data = f.read(nbytes)
        read.update(data[i:i + 4] for i in range(0, len(data) - 3, 4))
    returned = collections.Counter()
    for shards in got["shards"].values() if isinstance(got["shards"], dict) else []:
        for t in filter(torch.is_tensor, shards.values() if isinstance(shards, dict) else []):
            data = t.detach().float().contiguous().numpy().tobytes()
            returned.update(data[i:i + 4] for i in range(0, len(data), 4))
    if returned != read:
        word = next(iter(returned - read), None)
        value = None if word is None else torch.frombuffer(bytearray(word), dtype=torch.float32)
        raise AssertionError(
            f"{where} read as many bytes as its shards hold, but returned other values than "
            "it read" + ("" if value is None else f" (e.g. {value.item():.6g}, which it never "
                                                 "read)")
            + ": every element returned must come from its own read through reader.read")


def _bytes_hint(read, need, total) -> str:
    if read == 0:
        return "Read the checkpoint only through reader.read(file, offset, nbytes)."
    if read >= total:
        return ("Reading whole files (or whole flat tensors) and slicing afterwards moves "
                "every rank's share through every rank: read only each shard's elements.")
    if read > need:
        return ("Read only the elements you keep: a column-parallel shard is one contiguous "
                "range of its flat tensor; a row-parallel one is a range in each row (not "
                "whole rows).")
    return "Some elements were not read at all; every element returned must come from a read."

