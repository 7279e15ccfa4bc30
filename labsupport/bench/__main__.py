"""Benchmarks that print numbers and ratios (speed targets live here, not in tests).

    python -m labsupport.bench launcher       # the launcher vs bare torch.multiprocessing
    python -m labsupport.bench collectives    # busbw of every collective over message sizes
    python -m labsupport.bench ring           # chapter 2's ring all-reduce vs dist.all_reduce
    python -m labsupport.bench p2p            # one ring exchange (batch_isend_irecv), timed
    python -m labsupport.bench ddp            # chapter 3's data-parallel versions vs DDP
    python -m labsupport.bench pipeline       # chapter 5's measured bubbles vs the formulas
    python -m labsupport.bench memory         # chapter 0: bytes counted vs the formulas
    python -m labsupport.bench ring_attention # chapter 6's ring: overlap, causal skew, vs SDPA
    python -m labsupport.bench tp             # chapter 4's tensor parallelism vs DTensor
    python -m labsupport.bench zero           # chapter 7's memory vs formula, ZeRO-3 vs FSDP2
    python -m labsupport.bench moe            # chapter 9's all-to-all bytes, vs torch's, balance
    python -m labsupport.bench overlap        # time beside bytes: crossings, every chapter
    python -m labsupport.bench checkpoint     # chapter 10: shard bytes, reshard, resume, async,
                                              #   2 nodes
    python -m labsupport.bench capstone       # chapter 11: parity, hand vs PyTorch's
                                              #   composition, MFU, resume
    python -m labsupport.bench debug          # chapter 12: the fault zoo named, DETAIL's and
                                              #   the Flight Recorder's cost
    python -m labsupport.bench hub            # a class logging in at once to the course's hub
                                              #   (root)
    python -m labsupport.bench <name> --help
"""
import importlib
import sys

BENCHMARKS = {
    "launcher": "labsupport.bench.launcher",
    "collectives": "labsupport.collectives.bench",
    "ring": "labsupport.ring.bench",
    "p2p": "labsupport.ring.exchange_bench",
    "ddp": "labsupport.data_parallel.bench",
    "pipeline": "labsupport.pipeline.bench",
    "memory": "labsupport.memory.bench",
    "ring_attention": "labsupport.context_parallel.bench",
    "tp": "labsupport.tensor_parallel.bench",
    "zero": "labsupport.zero.bench",
    "moe": "labsupport.expert_parallel.bench",
    "checkpoint": "labsupport.checkpoints.bench",
    "capstone": "labsupport.capstone.bench",
    "debug": "labsupport.debugging.bench",
    "overlap": "labsupport.bench.overlap",
    "hub": "labsupport.bench.hub",
}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in BENCHMARKS:
        names = ", ".join(sorted(BENCHMARKS))
        sys.exit(f"usage: python -m labsupport.bench {{{names}}} [options]")
    importlib.import_module(BENCHMARKS[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    main()
