"""The checks of chapter 10 (checkpoints and failures): which saved bytes a new rank
reads when resharding, and whether a resumed run is the uninterrupted one.

    checkpoints.check_read_plan(read_plan)                           # in the kernel
    checkpoints.compare_resumed(resumed_records, uninterrupted, resume_at)

Each check says what is wrong with an answer: the case, what came back, what
was expected and the likely reason.
"""

# (Ψ elements, ranks that saved, ranks that load): shrinking, growing, a rank
# with nothing to read (Ψ = 3 over 4 new ranks), and N' not dividing Ψ.
RESHARDS = [(37, 4, 2), (37, 4, 1), (37, 2, 4), (1001, 4, 3), (5, 4, 4), (3, 2, 4)]
ITEMSIZE = 4

# Why a resumed step can differ from the uninterrupted run, by the field that differs.
WHY = dict(step="the resumed run started at the wrong step",
           samples="the data position (loader.position) was not restored",
           lr="the learning rate: the scheduler's state, and the lr it sets "
              "in scheduler.optimizer.param_groups, were not restored",
           rng="the random stream (torch.get_rng_state(), per rank) was not "
               "restored: other dropout masks",
           loss="the losses differ although step, data, lr and RNG agree")


def saved_pieces(numel, world_size, itemsize=ITEMSIZE):
    """The pieces ``save_sharded`` records for a ZeRO flat tensor of ``numel``."""
    shard = -(-numel // world_size)
    return [dict(file=f"rank{r}.bin", offset=8 + 3 * itemsize * r,
                 start=min(r * shard, numel),
                 length=max(0, min(shard, numel - r * shard)))
            for r in range(world_size)]


def element_map(plan, length, itemsize=ITEMSIZE):
    """For each element of the new slice: (file, byte offset) from ``plan``, or None."""
    where = [None] * length
    for file, offset, count, position in plan:
        for k in range(count):
            if not 0 <= position + k < length:
                raise AssertionError(f"position {position + k} is outside the new "
                                     f"slice of {length} elements")
            where[position + k] = (file, offset + k * itemsize)
    return where


def check_read_plan(fn):
    """``fn(pieces, start, length, itemsize)`` for every new rank of ``RESHARDS``."""
    for numel, old_n, new_n in RESHARDS:
        pieces, new = saved_pieces(numel, old_n), -(-numel // new_n)
        for r in range(new_n):
            start, length = r * new, min(new, max(0, numel - r * new))
            want = element_map(_overlaps(pieces, start, length), length)
            got = element_map(fn(pieces, start, length, ITEMSIZE), length)
            for k, (g, w) in enumerate(zip(got, want)):
                yours = f"your plan reads {g}" if g else "your plan misses it"
                if g != w:
                    raise AssertionError(
                        f"Ψ = {numel} saved by {old_n} ranks, new rank {r} of {new_n} "
                        f"(elements [{start}, {start + length})): element {start + k} "
                        f"should come from {w[0]} at byte {w[1]}; {yours}")


def _overlaps(pieces, start, length):
    plan = []
    for p in pieces:
        lo, hi = max(start, p["start"]), min(start + length, p["start"] + p["length"])
        if lo < hi:
            plan.append((p["file"], p["offset"] + (lo - p["start"]) * ITEMSIZE,
                         hi - lo, lo - start))
    return plan


def compare_resumed(runs, uninterrupted, resume_at):
    """Each rank's records after a resume at ``resume_at`` against the uninterrupted
    run's: step, samples, learning rate, random stream and loss, equal."""
    for rank, (got, want) in enumerate(zip(runs, uninterrupted)):
        if len(got) != len(want) - resume_at:
            raise AssertionError(f"rank {rank} resumed at step "
                                 f"{got[0]['step'] if got else '-'}, expected "
                                 f"{resume_at}: {WHY['step']}")
        for g, w in zip(got, want[resume_at:]):
            for key in ("step", "samples", "lr", "rng", "loss"):
                if g[key] != w[key]:
                    raise AssertionError(f"rank {rank}, step {w['step']}: {key} {g[key]} "
                                         f"instead of {w[key]}: {WHY[key]}")
