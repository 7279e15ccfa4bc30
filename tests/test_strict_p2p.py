# Run: .venv/bin/python -m pytest tests/test_strict_p2p.py   (~60 s on 2 idle cores)
"""LABSUPPORT_P2P=strict: NCCL's point-to-point rules on gloo (labsupport.launch.strict_p2p).

What NCCL does and gloo does not, replayed on a CPU: tags ignored (messages
between two ranks match in issue order); each unbatched operation complete
before the group's next one starts; a send complete only once its receiver
has started the matching receive; the operations of one batch_isend_irecv
progressing together. The course's old patterns (chapter 5's receives
posted before the sends, chapter 2's segments sent ahead of their
receives, chapter 1's direct all-gather of unbatched isends, chapter 6's
ring step) run under gloo's own rules and hang under strict mode, where the
deadlock diagnosis says why; their fixed forms pass. The whole suite runs
in strict mode (conftest.py), so every other test of p2p code shows the
fixed forms pass too.
"""
import time

import pytest
import torch
import torch.distributed as dist

import labsupport as ls
import strict_patterns as old
from grading_rings import direct_all_gather
from labsupport import models
from labsupport.context_parallel import ring_attention
from labsupport.launch import strict_p2p
from labsupport.pipeline import pipeline
from labsupport.ring import ring

SHORT = 3.0  # s, the deadline of the runs that hang on purpose


def start(monkeypatch, mode, world_size=2):
    """A group whose ranks run by ``mode``'s rules ("strict" or gloo's own, "")."""
    monkeypatch.setenv(strict_p2p.ENV, mode)
    return ls.start(world_size=world_size, backend="gloo")


@pytest.fixture
def strict(monkeypatch):
    cluster = start(monkeypatch, "strict")
    yield cluster
    ls.shutdown()


def test_the_mode_is_read_from_the_environment_and_a_typo_is_refused(monkeypatch):
    for value, expected in (("strict", True), ("STRICT ", True), ("", False), ("gloo", False)):
        monkeypatch.setenv(strict_p2p.ENV, value)
        assert strict_p2p.requested() is expected
    monkeypatch.setenv(strict_p2p.ENV, "nccl")
    with pytest.raises(ValueError, match="LABSUPPORT_P2P='nccl': use 'strict'"):
        strict_p2p.requested()


def _tagged():
    """Rank 0 sends 1 (tag 7) then 2 (tag 3); rank 1 asks for tag 3 first."""
    got = [torch.zeros(1), torch.zeros(1)]
    if dist.get_rank() == 0:
        for work in [dist.isend(torch.ones(1), 1, tag=7),
                     dist.isend(torch.ones(1) * 2, 1, tag=3)]:
            work.wait()
    else:
        dist.recv(got[1], 0, tag=3)
        dist.recv(got[0], 0, tag=7)
    return [t.item() for t in got], strict_p2p.active()


def test_tags_are_ignored_messages_match_in_issue_order(monkeypatch):
    assert start(monkeypatch, "").run(_tagged)[1] == ([1.0, 2.0], False)  # gloo: by tag
    assert start(monkeypatch, "strict").run(_tagged)[1] == ([2.0, 1.0], True)  # NCCL: order
    ls.shutdown()


def _rendezvous():
    """Rank 1 posts its receive a second late: how long did rank 0's send take?"""
    if dist.get_rank() == 1:
        time.sleep(1.0)
        dist.recv(torch.empty(1000), 0)
        return None
    start = time.perf_counter()
    work = dist.isend(torch.ones(1000), 1)
    posted = time.perf_counter() - start
    work.wait()
    return posted, time.perf_counter() - start


def test_a_send_completes_only_once_its_receive_has_started(strict):
    posted, done = strict.run(_rendezvous)[0]
    assert posted < 0.5 <= 0.9 < done  # isend returns at once; the send waits


def test_a_receive_from_any_rank_is_refused(strict):
    with pytest.raises(ls.RankError, match="a message from any rank, which NCCL cannot do"):
        strict.run(lambda: dist.recv(torch.zeros(1)) if dist.get_rank() else None)


@pytest.mark.parametrize("pattern, args", [
    (old.old_ring_step, (old.filled, 8)),
    (old.old_direct_all_gather, (old.filled, 8)),
    (old.old_pipelined_ring, (old.filled, 4096)),
], ids=["ch6-ring-step", "ch1-direct-all-gather", "ch2-pipelined-ring"])
def test_an_old_pattern_runs_on_gloo_and_hangs_by_nccls_rules(monkeypatch, pattern, args):
    make, numel = args
    plain = start(monkeypatch, "").run(lambda: pattern(make(numel)))
    assert all(torch.isfinite(t).all() for t in plain)
    with pytest.raises(ls.RankTimeout):
        start(monkeypatch, "strict").run(lambda: pattern(make(numel)), timeout=SHORT)
    ls.shutdown()


def test_the_old_pipeline_harness_hangs_and_the_diagnosis_says_why(monkeypatch):
    assert start(monkeypatch, "").run(old.old_pipeline_1f1b)  # gloo: tags save it
    start(monkeypatch, "strict")
    with pytest.raises(AssertionError) as info:
        ls.grading.run(old.old_pipeline_1f1b, world_size=2, timeout=SHORT)
    text = str(info.value)
    assert text.startswith("old_pipeline_1f1b did not finish within 3 s on 2 ranks")
    # rank 0 posted every receive first: its sends could not start behind them
    assert "rank 0 waited 3 s for a 64-element tensor from rank 1 (dist.irecv)" in text
    assert ("Its dist.isend of a 64-element tensor to rank 1, issued after it, could not "
            "start before it completed.") in text
    assert "Under NCCL's rules (LABSUPPORT_P2P=strict runs gloo by them)" in text
    assert "in one dist.batch_isend_irecv" in text
    ls.shutdown()


def test_a_call_queued_behind_an_earlier_one_is_named(strict):
    def late_receive():  # rank 0: an irecv from 1 (never sent), then a recv from 1
        if dist.get_rank() == 0:
            dist.irecv(torch.zeros(3), 1)
            dist.recv(torch.zeros(2), 1)
        else:
            time.sleep(30)

    with pytest.raises(AssertionError) as info:
        ls.grading.run(late_receive, world_size=2, timeout=SHORT)
    text = str(info.value)
    assert ("rank 0 waited 3 s for a 2-element tensor from rank 1 (dist.recv), queued behind "
            "its own earlier dist.irecv of a 3-element tensor from rank 1, which had not "
            "completed") in text


def _fixed_forms():
    """The fixed forms of the patterns above, each checked against the library."""
    rank, n = dist.get_rank(), dist.get_world_size()
    x = old.filled(10_001)
    want = x.clone()
    dist.all_reduce(want)
    assert torch.equal(ring.ring_allreduce(x.clone(), segment_bytes=4096), want)
    gathered = torch.full((8,), float("nan"))
    gathered.tensor_split(n)[rank].fill_(rank)
    direct_all_gather(gathered)
    assert gathered.tolist() == [float(r) for r in range(n) for _ in range(8 // n)]
    incoming = torch.empty(4)
    for work in ring_attention.ring_exchange(torch.full((4,), float(rank)), incoming):
        work.wait()
    assert incoming.eq((rank - 1) % n).all()
    x, y = models.toy_regression(16, 8, 4, seed=1)
    step = pipeline.run_step(pipeline.train_step_interleaved, x, y, 4, 2,
                             dict(d_in=8, width=16, depth=9, d_out=4, seed=0))
    return len(step["grads"])


def test_their_fixed_forms_pass_by_nccls_rules(strict):
    per_rank = strict.run(_fixed_forms, timeout=60)
    assert sum(per_rank) == 20  # the 10 Linear layers' weights and biases, once


def _callbacks_before_wait_returns():
    """Rank 0's requests get a slow completion callback before they can complete
    (rank 1 posts late): has it run when their wait() returns?"""
    peer, ran = 1 - dist.get_rank(), []
    if dist.get_rank() == 1:
        time.sleep(0.3)
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.ones(2), peer),
                                    dist.P2POp(dist.irecv, torch.empty(2), peer)])
    for work in works:
        work.on_done(lambda: (time.sleep(0.2), ran.append(True)))
    for work in works:
        work.wait()
    return len(ran)


def test_a_request_is_done_only_once_its_callbacks_have_run(strict):
    """What p2p_log's "done" relies on: written before the waiter's record closes
    (else a late write hit a closed file, and the rank's stderr zeroed a cell)."""
    assert strict.run(_callbacks_before_wait_returns, timeout=20) == [2, 2]


def _waits_twice():
    peer = 1 - dist.get_rank()
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.ones(2), peer),
                                    dist.P2POp(dist.irecv, torch.empty(2), peer)])
    for work in works + works[:1]:  # the send's request a second time
        work.wait()


def test_a_request_waited_for_twice_is_refused_as_gloo_would_hang(strict):
    with pytest.raises(ls.RankError, match="already waited for: on gloo a second wait"):
        strict.run(_waits_twice, timeout=10)
