# Run: flock /tmp/course-heavy.lock .venv/bin/python -m pytest tests/test_sharded_checkpoint.py
"""Chapter 10's sharded checkpoint and resumable training: parity, refusals, DCP, cleanup.

Through the launcher, on the chapter's small decoder: a ZeRO-3 checkpoint
saved by 4 ranks, loaded by 2 and saved again, then loaded by 1, holds
bitwise the state the 4 ranks saved; a run resumed from a mid-run
checkpoint gives the uninterrupted run's losses bitwise; a save that dies
halfway leaves a ``.tmp`` directory that every reader refuses with a clear
message (as it does a damaged file), while the previous checkpoint stays
the latest; a checkpoint of ours, sharded by FSDP2 and saved with DCP,
loads in one process bitwise; the two-node launcher stops every process at
its deadline. The notebook's lesson cells are the package's. (The two-node
restart end to end: tests/test_bench_checkpoint.py.) Every file goes under
pytest's temporary directory.
"""
import os
import sys
import time

import cloudpickle
import pytest
import torch
import torch.distributed as dist

import labsupport as ls
from labsupport.checkpoints import elastic, resumable
from labsupport.checkpoints import sharded_checkpoint as sc
from nbtools import assert_lesson_copy

RECIPE = resumable.Recipe(seq_len=8, hidden=15, heads=3, layers=2, data_size=16)
STEPS, HALF = 6, 4
cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.mark.parametrize("module", [sc, resumable], ids=["sharded_checkpoint", "resumable"])
def test_the_notebook_copies_are_identical(module):
    assert_lesson_copy(module)


def held(root):
    """The newest checkpoint under root in a fresh ZeRO-3 model: this rank's pieces."""
    model, optimizer, scheduler, loader, _ = resumable.setup(RECIPE)
    step = resumable.resume(root, model, optimizer, scheduler, loader,
                            resumable.restore_training_state)
    return step, {k: t.clone() for k, (t, _, _) in sc.zero3_pieces(model, optimizer).items()}


def train_save_hold(root, steps):
    resumable.train(RECIPE, root, steps, steps, resumable.training_state,
                    resumable.restore_training_state)
    return held(root)


def joined(by_rank):
    return {name: torch.cat([pieces[name] for _, pieces in by_rank]) for name in by_rank[0][1]}


def test_reshard_4_to_2_to_1_is_bitwise(tmp_path):
    at4 = ls.run(train_save_hold, str(tmp_path / "a"), HALF, world_size=4)
    at2 = ls.run(held, str(tmp_path / "a"), world_size=2)        # 4 -> 2
    model_then_save = ls.run(save_again, str(tmp_path / "a"), str(tmp_path / "b"),
                             world_size=2)
    at1 = ls.run(held, str(tmp_path / "b"), world_size=1)        # 2 -> 1
    whole = joined(at4)
    for by_rank in (at2, model_then_save, at1):
        again = joined(by_rank)
        assert again.keys() == whole.keys()
        assert all(torch.equal(again[k], whole[k]) for k in whole)
    assert {step for step, _ in at1} == {HALF}
    meta = sc.read_metadata(str(tmp_path / "b" / f"step{HALF:06d}"))
    assert meta["world_size"] == 2 and meta["layout"]["unit0"][0][0] == "blocks.0.ln1.weight"


def save_again(src, dst):
    """Load src at this N and save what was loaded under dst (same step)."""
    model, optimizer, scheduler, loader, _ = resumable.setup(RECIPE)
    step = resumable.resume(src, model, optimizer, scheduler, loader,
                            resumable.restore_training_state)
    sc.save_sharded(os.path.join(dst, f"step{step:06d}"), sc.zero3_pieces(model, optimizer),
                    resumable.training_state(step, loader, scheduler),
                    layout=sc.unit_layout(model))
    return held(dst)


def test_a_resumed_run_gives_the_uninterrupted_losses_bitwise(tmp_path):
    run = dict(steps=STEPS, every=STEPS + 1, world_size=2)
    reference = ls.run(resumable.train, RECIPE, str(tmp_path / "ref"), capture=None,
                       restore=None, **run)
    root = str(tmp_path / "ckpt")
    ls.run(resumable.train, RECIPE, root, HALF, HALF, resumable.training_state,
           resumable.restore_training_state, world_size=2)
    resumed = ls.run(resumable.train, RECIPE, root, capture=resumable.training_state,
                     restore=resumable.restore_training_state, **run)
    for ref, res in zip(reference, resumed):
        assert [r["step"] for r in res] == list(range(HALF, STEPS))
        for key in ("loss", "lr", "samples", "rng"):
            assert [r[key] for r in res] == [r[key] for r in ref[HALF:]], key


class DiesHalfway(dict):
    def items(self):
        for i, item in enumerate(super().items()):
            if i == len(self) // 2:
                os._exit(1)
            yield item


def interrupted(root, step):
    model, optimizer, scheduler, loader, data = resumable.setup(RECIPE)
    resumable.train_step(model, optimizer, scheduler, loader, data)
    pieces = sc.zero3_pieces(model, optimizer)
    sc.save_sharded(os.path.join(root, f"step{step:06d}"),
                    DiesHalfway(pieces) if dist.get_rank() == 1 else pieces)


def test_a_save_that_dies_halfway_is_refused_and_the_last_one_stays(tmp_path):
    root = str(tmp_path)
    ls.run(resumable.train, RECIPE, root, 2, 2, resumable.training_state,
           resumable.restore_training_state, world_size=2)
    with pytest.raises(ls.RankError, match=r"rank 1 died \(exit code 1\)"):
        ls.run(interrupted, root, 4, world_size=2)
    assert sorted(os.listdir(root)) == ["step000002", "step000004.tmp"]
    assert sc.latest_checkpoint(root) == os.path.join(root, "step000002")
    with pytest.raises(sc.IncompleteCheckpoint, match="not a complete checkpoint .no "
                       "metadata.json: its save was interrupted.: load the latest complete"):
        sc.load_resharded(os.path.join(root, "step000004.tmp"), {})
    with open(os.path.join(root, "step000002", "rank1.bin"), "r+b") as f:
        f.truncate(100)                                         # damaged since
    with pytest.raises(sc.IncompleteCheckpoint, match="rank1.bin: 100 bytes on disk, the "
                       "metadata says .* this checkpoint is damaged"):
        sc.read_metadata(os.path.join(root, "step000002"))


def save_twice(root):
    pieces = {"w": (torch.arange(3.0), 3 * dist.get_rank(), 3 * dist.get_world_size())}
    for _ in range(2):
        sc.save_sharded(os.path.join(root, "step000001"), pieces)


def test_saving_a_step_twice_fails_on_every_rank_and_a_refused_extra_says_why(tmp_path):
    with pytest.raises(ls.RankError) as info:
        ls.run(save_twice, str(tmp_path), world_size=2)
    assert info.value.ranks == [0, 1]
    assert "step000001 exists: save each step once" in str(info.value)
    torch.save([{"loader": resumable.ShuffledBatches(4, 2, 0)}],
               tmp_path / "step000001" / "extra.pt")
    with pytest.raises(ValueError, match="save plain state .* loader.position rather than"):
        sc.read_extra(str(tmp_path / "step000001"))


def save_and_trace(root):
    """Save once, recording (what, path) of each fsync and rename rank 0 makes."""
    events, fsync, rename = [], os.fsync, os.rename

    def traced_fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        fsync(fd)

    def traced_rename(src, dst):
        events.append(("rename", os.path.abspath(dst)))
        rename(src, dst)

    os.fsync, os.rename = traced_fsync, traced_rename
    try:
        rank, n = dist.get_rank(), dist.get_world_size()
        pieces = {"w": (torch.arange(3.0), 3 * rank, 3 * n)}
        sc.save_sharded(os.path.join(root, "step000001"), pieces)
    finally:
        os.fsync, os.rename = fsync, rename
    return events


def test_the_rename_is_made_durable_by_fsyncs_of_both_directories(tmp_path):
    # atomic is not durable: the .tmp directory's entries are synced before the
    # rename and the parent's after it (Linux fsync(2): "an explicit fsync() on a
    # file descriptor for the directory is also needed")
    root = os.path.realpath(tmp_path)
    final = os.path.join(root, "step000001")
    events = ls.run(save_and_trace, root, world_size=2)[0]
    renamed = events.index(("rename", final))
    assert ("fsync", final + ".tmp") in events[:renamed]
    assert events[renamed + 1:] == [("fsync", root)]
    synced_files = {os.path.basename(path) for what, path in events[:renamed]
                    if what == "fsync"}
    assert {"rank0.bin", "metadata.json", "extra.pt"} <= synced_files


def fsdp2_saves(full, path):
    """FSDP2 at this N takes our whole state (set_state_dict), then DCP saves it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_state_dict,
        set_state_dict,
    )
    from torch.distributed.fsdp import fully_shard

    from labsupport import models
    model = models.GPT(models.GPTConfig(RECIPE.vocab_size, RECIPE.seq_len, RECIPE.hidden,
                                        RECIPE.heads, RECIPE.layers))
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters())
    options = StateDictOptions(full_state_dict=True)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    model_sd = {name: full["model"][name] for name in model_sd}
    for name, state in optim_sd["state"].items():
        state.update(full["optim"][name])
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd,
                   options=options)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # dcp.load here: one process
def test_dcp_interoperates_with_our_checkpoint(tmp_path):
    import torch.distributed.checkpoint as dcp

    from labsupport import models
    root = str(tmp_path / "ours")
    ls.run(resumable.train, RECIPE, root, 2, 2, resumable.training_state,
           resumable.restore_training_state, world_size=4)
    ours = sc.full_state(sc.latest_checkpoint(root))
    ours["model"]["lm_head.weight"] = ours["model"]["tok.weight"]        # tied
    ls.run(fsdp2_saves, ours, str(tmp_path / "dcp"), world_size=2)
    plain = models.GPT(models.GPTConfig(RECIPE.vocab_size, RECIPE.seq_len, RECIPE.hidden,
                                        RECIPE.heads, RECIPE.layers))
    state = {"model": plain.state_dict(), "optim": {"state": {
        name: {k: torch.empty_like(v) for k, v in moments.items()}
        for name, moments in ours["optim"].items()}}}
    dcp.load(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    for name, tensor in ours["model"].items():
        assert torch.equal(state["model"][name], tensor), name
    for name, moments in ours["optim"].items():
        for kind, tensor in moments.items():
            assert torch.equal(state["optim"]["state"][name][kind], tensor), (name, kind)


def test_the_two_node_launcher_stops_every_process_at_its_deadline(tmp_path):
    script = tmp_path / "sleeper.py"
    script.write_text("import time\nopen(__file__ + '.started', 'a').close()\n"
                      "time.sleep(600)\n")
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="passed its 8 s deadline; stopped both agents"):
        elastic.run_two_nodes([str(script)], str(tmp_path), timeout=8)
    assert time.monotonic() - t0 < 8 + elastic.STOP_WAIT + 5
    assert (tmp_path / "sleeper.py.started").exists()       # the workers had started
    left = [pid for pid in os.listdir("/proc") if pid.isdigit()
            and str(script).encode() in _cmdline(pid)]
    assert left == []


def _cmdline(pid) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""
