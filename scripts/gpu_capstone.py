"""The capstone on one GPU: the single-rank trainer on CUDA (NCCL, world size 1).

What made notebooks/recorded/gpu_capstone_h100_2026-11-28.json: run on a lent machine
with one NVIDIA H100 80GB HBM3 and its own torch 2.11.0+cu130, on 2026-11-28, as

    PYTHONPATH=.devrun:$PWD python scripts/gpu_capstone.py

where .devrun/sitecustomize.py (below, in the docstring) gave torch 2.11 the two
names of torch 2.13 that labsupport calls:

    import torch.distributed as d
    d.all_gather_single = getattr(d, "all_gather_single", d.all_gather_into_tensor)
    d.reduce_scatter_single = getattr(d, "reduce_scatter_single", d.reduce_scatter_tensor)

The results land in $OUT/gpu_capstone.json. Chapter 11 reads the recorded file.
"""
import json
import os
import time

import torch

import labsupport as ls
from labsupport.capstone import trainer

print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0),
      flush=True)
res = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0)}

# (sequence_parallel=False: torch 2.11 there has no dist.reduce_scatter_single)
# 1. parity on the GPU: the one-rank trainer (lesson code, NCCL group of 1, CUDA tensors)
#    against the one-process reference on the CPU, fp32, 4 steps, the tests' sizes
ref = trainer.reference(4)["losses"]
out = ls.run(trainer.train, (1, 1, 1, 1), 4, world_size=1, sequence_parallel=False)
print("backend on the rank:", ls.run(ls.backend_of, world_size=1), flush=True)
gpu = out[0]["losses"]
rel = max(abs(a - b) / abs(b) for a, b in zip(gpu, ref))
print("parity: GPU losses", [f"{x:.6f}" for x in gpu], "CPU", [f"{x:.6f}" for x in ref],
      f"max rel diff {rel:.2e}", flush=True)
res["parity_max_rel"] = rel

# 2. throughput of one rank: a GPT-2-small-shaped decoder on byte tokens, fp32
def flops_per_token(L, h, s, V, causal):
    n = L * 12 * h * h + 2 * V * h          # weights of blocks + untied embedding/head
    attn = (6 if causal else 12) * L * h * s
    return 6 * n + attn, n

for name, size, batch, s, m in [("h768 L12", dict(hidden=768, heads=12, layers=12), 16, 512, 1),
                                ("h1024 L8", dict(hidden=1024, heads=16, layers=8), 16, 1024, 1)]:
    t0 = time.time()
    r = ls.run(trainer.train, (1, 1, 1, 1), 12, world_size=1, model=dict(size, seq_len=s),
               batch=batch, seq_len=s, micro_batches=m, warmup=4, timeout=400,
               sequence_parallel=False)[0]
    tps = r["tokens_per_s"]
    f12, n = flops_per_token(size["layers"], size["hidden"], s, 256, causal=False)
    f6, _ = flops_per_token(size["layers"], size["hidden"], s, 256, causal=True)
    row = dict(model=name, params=n, batch=batch, seq_len=s, tokens_per_s=tps,
               tflops_12=tps * f12 / 1e12, tflops_6=tps * f6 / 1e12,
               mfu_fp32_67=tps * f12 / 67e12, mfu_bf16_989=tps * f12 / 989e12,
               loss_first=r["losses"][0], loss_last=r["losses"][-1], wall=time.time() - t0)
    print(json.dumps(row), flush=True)
    res[name] = row
os.makedirs(os.environ.get("OUT", "/tmp/out"), exist_ok=True)
json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp/out"), "gpu_capstone.json"), "w"),
          indent=1)
