# Run: PYTHONPATH=$PWD .venv/bin/python -m pytest tests/test_capstone_resume.py -q
"""The capstone's checkpoint (DCP), saved at one layout and resumed at another.

A run at 2x2x2x1 saves every two steps; resumed from step 2 at 4x1x2x1
(dp 2 -> 4, tp 2 -> 1), at 1x2x2x2 (dp 2 -> 1, cp 1 -> 2) and at 2x1x1x1
(tp 2 -> 1, pp 2 -> 1: every block on one stage), the losses of
the remaining steps equal the uninterrupted run's within the parity tolerance
(``compare.LOSS_RTOL``), the data position carried across the change of dp.
What each rank of the new layout loads is, bit for bit, its slice of the
whole tensors that the checkpoint holds (read back in one process), and
those are the saving run's weights. A three-block decoder saved at two stages
(blocks 0-1 and 2) resumes at three (one block each) and continues the same
way. A resume with another global batch,
sequence length or decoder is refused, saying what differs.
"""
import math
import os
import sys

import cloudpickle
import pytest
import torch

import labsupport as ls
from labsupport.capstone import checkpoint, compare, trainer
from labsupport.capstone.model import config

cloudpickle.register_pickle_by_value(sys.modules[__name__])

SAVED_AT, STEPS, EVERY = (2, 2, 2, 1), 4, 2
RESUME_AT = [(4, 1, 2, 1), (1, 2, 2, 2), (2, 1, 1, 1)]


def _train(layout, steps=STEPS, **kw):
    return ls.run(trainer.train, layout, steps, world_size=math.prod(layout),
                  backend="gloo", **kw)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The uninterrupted run: its results and its checkpoints' root."""
    root = str(tmp_path_factory.mktemp("ckpt"))
    outs = _train(SAVED_AT, checkpoint_every=EVERY, checkpoint_dir=root,
                  return_params=True)
    return outs, root


def test_the_run_saves_complete_checkpoints_holding_its_weights(saved):
    outs, root = saved
    assert sorted(os.listdir(root)) == ["step000002", "step000004"]
    assert checkpoint.latest(root) == os.path.join(root, "step000004")
    whole = checkpoint.full_state(checkpoint.latest(root))
    assert whole["meta"]["step"] == 4 and whole["meta"]["layout"] == list(SAVED_AT)
    assert whole["meta"]["loader"]["step"] == 4          # global batches taken
    params = compare.full_params(outs)
    assert whole["model"].keys() == params.keys()
    for name, p in params.items():                       # the pieces, put together
        assert torch.equal(whole["model"][name], p), name
    for name, state in whole["optim"].items():
        assert state["exp_avg"].shape == params[name].shape
        assert float(state["step"]) == 4.0


def _load_at(directory, layout):
    """On every rank: build ``layout``'s stage, load the checkpoint into it."""
    import torch
    import torch.distributed as dist

    from labsupport.capstone import checkpoint, trainer
    from labsupport.capstone import data as capdata
    from labsupport.capstone.layout import Layout
    cfg = config(vocab_size=256, seq_len=32, hidden=32, heads=4, layers=2)  # train's
    stage, groups, coords = trainer.build(layout, cfg)
    opt = torch.optim.AdamW(stage.parameters(), lr=3e-3, weight_decay=0.0)
    loader = capdata.Loader(capdata.corpus()[:4096], 8, 32, 0, layout[0], coords.dp,
                            layout[3], coords.cp)
    meta = checkpoint.run_meta(cfg, Layout(*layout), loader.state_dict(), "adamw",
                               torch.float32)
    step = checkpoint.load(directory, stage, opt, loader, meta)
    return dict(step=step, loader=loader.step, rank=dist.get_rank(),
                shards=stage.shards(), coords=tuple(coords),
                params={n: p.detach().clone() for n, p in stage.named_parameters()},
                optim={n: {k: v.clone() for k, v in opt.state[p].items()}
                       for n, p in stage.named_parameters()})


@pytest.mark.parametrize("layout", RESUME_AT, ids=lambda lay: "x".join(map(str, lay)))
def test_each_rank_loads_its_slice_of_the_saved_tensors(saved, layout):
    directory = checkpoint.path_for(saved[1], 2)
    whole = checkpoint.full_state(directory)
    outs = ls.run(_load_at, directory, layout, world_size=math.prod(layout),
                  backend="gloo")
    held = set()
    for o in outs:
        assert (o["step"], o["loader"]) == (2, 2)
        for name, p in o["params"].items():
            held.add(name)
            shard = o["shards"][name]
            want = compare.local_slice(whole["model"][name], shard)
            assert torch.equal(p, want), name
            for key, v in o["optim"][name].items():
                want = whole["optim"][name][key]
                want = want if key == "step" else compare.local_slice(want, shard)
                assert torch.equal(v, want), (name, key)
    assert held == set(whole["model"])              # every tensor, somewhere


@pytest.mark.parametrize("layout", RESUME_AT, ids=lambda lay: "x".join(map(str, lay)))
def test_resumed_on_another_layout_the_loss_continues(saved, layout):
    outs, root = saved
    want = outs[0]["losses"]
    resumed = _train(layout, resume=checkpoint.path_for(root, 2), return_params=True)
    assert {o["first_step"] for o in resumed} == {2}
    got = resumed[0]["losses"]
    assert len(got) == STEPS - 2 and len({tuple(o["losses"]) for o in resumed}) == 1
    for k, loss in enumerate(got, start=2):
        assert abs(loss - want[k]) <= compare.LOSS_RTOL * abs(want[k]), (k, loss, want)
    # and it ends where the uninterrupted run ended
    mine, theirs = compare.full_params(resumed), compare.full_params(outs)
    for name, p in mine.items():
        if name.endswith("attn.k.bias"):   # zero gradient + Adam: noise (test_capstone)
            assert (p - theirs[name]).abs().max() <= 2 * 3e-3
            continue
        torch.testing.assert_close(p, theirs[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("change, message", [
    (dict(batch=4), "batch=8 saved, 4 here"),
    (dict(seq_len=16), "seq_len=32 saved, 16 here"),
    (dict(model={"hidden": 48}), "hidden=32 saved, 48 here"),
    (dict(optimizer="sgd"), "optimizer=adamw saved, sgd here"),
])
def test_a_resume_that_changes_the_run_is_refused(saved, change, message):
    with pytest.raises(ls.RankError, match=message):
        _train((2, 1, 1, 1), resume=checkpoint.path_for(saved[1], 2), **change)


def test_a_resume_with_nothing_left_to_train_is_refused(saved):
    with pytest.raises(ls.RankError, match="at step 4: steps=4 leaves nothing"):
        _train((2, 1, 1, 1), resume=checkpoint.path_for(saved[1], 4))


def test_latest_skips_incomplete_saves(tmp_path):
    assert checkpoint.latest(str(tmp_path)) is None
    assert checkpoint.latest(str(tmp_path / "absent")) is None
    for name, complete in [("step000002", True), ("step000004", False),
                           ("step000006.tmp", True)]:
        (tmp_path / name).mkdir()
        if complete:
            (tmp_path / name / checkpoint.DCP_METADATA).write_bytes(b"")
    assert checkpoint.latest(str(tmp_path)) == str(tmp_path / "step000002")


def test_resume_parity_for_the_notebook_and_the_benchmark():
    r = compare.resume_parity((2, 2, 2, 1), (1, 2, 2, 2), steps=3, save_at=1)
    assert r["equal"] and len(r["resumed"]) == len(r["uninterrupted"]) == 2, r
    assert r["max_rel"] <= compare.LOSS_RTOL


def test_a_resume_may_change_the_number_of_pipeline_stages():
    # 3 blocks: saved as stages of 2 and 1 blocks, resumed as 3 stages of one
    r = compare.resume_parity((1, 1, 2, 1), (1, 1, 3, 1), steps=3, save_at=1,
                              model=dict(layers=3))
    assert r["equal"] and len(r["resumed"]) == 2, r
