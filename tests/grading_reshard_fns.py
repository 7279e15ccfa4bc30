"""Assignment 8's functions, right and wrong, for tests/test_grading_reshard_to_tensor_parallel.py.

Imports only torch and the assignment's grader module (the ranks import this
module to unpickle each function). ``load_tp_shard`` is the assignment's
solution, kept identical by a test; the others are plausible wrong answers.
"""
import math

import torch
import torch.distributed as dist

import labsupport.grading.reshard_to_tensor_parallel as gr


def load_tp_shard(reader, kind, tp_rank, tp_size):
    """{parameter name: this tp rank's shard of it}, for `kind`, read by offsets."""
    meta = reader.metadata

    def elements(pieces, first, count):
        # elements [first, first + count) of a flat fp32 tensor, from the pieces holding them
        out = torch.empty(count)
        for p in pieces:
            lo, hi = max(first, p["start"]), min(first + count, p["start"] + p["length"])
            if lo < hi:
                data = reader.read(p["file"], p["offset"] + 4 * (lo - p["start"]), 4 * (hi - lo))
                out[lo - first:hi - first] = torch.frombuffer(bytearray(data), dtype=torch.float32)
        return out

    def shard(pieces, base, shape, dim):
        # the parameter starting at element `base`: the part this tp rank keeps
        rows, cols = shape[0], math.prod(shape[1:])
        if dim is None:
            return elements(pieces, base, rows * cols).view(shape)
        if dim == 0:                                     # whole rows: one range
            part = rows // tp_size
            return elements(pieces, base + tp_rank * part * cols, part * cols).view(
                part, *shape[1:])
        width = cols // tp_size                          # a range in every row
        return torch.stack([elements(pieces, base + row * cols + tp_rank * width, width)
                            for row in range(rows)])

    shards = {}
    for unit, params in meta["layout"].items():
        pieces, base = meta["tensors"][f"{unit}.{kind}"]["pieces"], 0
        for name, shape in params:
            shards[name] = shard(pieces, base, shape, gr.split_dim(name))
            base += math.prod(shape)
    return shards


def _flat(reader, kind):
    """Every unit's whole flat tensor (all its pieces), read in full."""
    meta, out = reader.metadata, {}
    for unit in meta["layout"]:
        parts = []
        for p in meta["tensors"][f"{unit}.{kind}"]["pieces"]:
            data = reader.read(p["file"], p["offset"], 4 * p["length"])
            parts.append(torch.frombuffer(bytearray(data), dtype=torch.float32))
        out[unit] = torch.cat(parts)
    return out


def reads_whole(reader, kind, tp_rank, tp_size):
    """Right values, too many bytes: reads every flat tensor whole, then slices."""
    flat, shards = _flat(reader, kind), {}
    for unit, params in reader.metadata["layout"].items():
        base = 0
        for name, shape in params:
            whole = flat[unit][base:base + math.prod(shape)].view(shape)
            dim = gr.split_dim(name)
            shards[name] = whole if dim is None else whole.chunk(tp_size, dim)[tp_rank]
            base += math.prod(shape)
    return shards


def rows_only(reader, kind, tp_rank, tp_size):
    """Wrong: row-parallel weights split by rows (dim 0), like the column-parallel ones."""
    real = gr.split_dim
    gr.split_dim = lambda name: None if real(name) is None else 0
    try:
        return load_tp_shard(reader, kind, tp_rank, tp_size)
    finally:
        gr.split_dim = real


def waits_for_rank0(reader, kind, tp_rank, tp_size):
    """Deadlock: ranks 1.. wait for a broadcast from tp rank 0, which never sends it."""
    size = torch.zeros(1)
    if tp_rank != 0:
        dist.broadcast(size, src=0)
    return load_tp_shard(reader, kind, tp_rank, tp_size)
