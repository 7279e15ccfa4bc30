"""A load that reads every flat tensor whole, for tests/test_grading_reshard_to_tensor_parallel.py.

The reference is the source notebook's (tests/sources.py), and the wrong
answers that differ from it in one thing are written there as edits of it;
this one is another design: right values, every rank reading everything.
It uses only the names the assignment's import cell gives (math, torch,
gr), so that the nbgrader test can paste its source into a submission. In
its own module, which imports only torch and the assignment's grader module:
the ranks import it to unpickle each function.
"""
import math

import torch

import labsupport.grading.reshard_to_tensor_parallel as gr


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


def copies_the_answer(reader, kind, tp_rank, tp_size):
    """Wrong: the grader's own expected shards, and reads from the start of the files
    that only add up to the right count of bytes."""
    shards = gr.expected(reader.directory, tp_rank)[kind]
    need = sum(t.numel() * t.element_size() for t in shards.values())
    for file, size in reader.metadata["files"].items():
        if need:
            reader.read(file, 0, min(size, need))
            need -= min(size, need)
    return shards
