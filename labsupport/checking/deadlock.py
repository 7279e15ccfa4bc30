"""Explain a deadlock: what each stopped rank waited for, from its ``p2p_log`` record.

    print(deadlock.explain({rank: p2p_log.read(path) ...}, stuck_ranks, time.time()))
      rank 1 waited 20 s for rank 0's chunk 2 (dist.irecv); rank 0 had already
      returned without sending it.

The launcher stops ranks that miss their deadline and reports where each one
was in its Python code; this says which message it was waiting for and what
the rank that should have sent it was doing, which is what a student needs to
find a missing or misordered send.
"""
from labsupport import p2p_log


def explain(logs: dict, stuck: list, now: float, stalled: bool = False) -> str:
    """One line per stopped rank: what it waited for, and what its peer was doing.
    ``stalled``: the launcher saw every stuck rank wait, using no CPU time (so
    one the record shows outside any call waited in a call it does not see)."""
    states = {rank: p2p_log.rank_state(events) for rank, events in logs.items()}
    lines = [_describe_rank(rank, states, set(stuck), now, stalled) for rank in stuck]
    return "  " + "\n  ".join(lines) + _deadlock_hint(states, stuck)


def _describe_rank(rank, states, stuck, now, stalled=False) -> str:
    st = states[rank]
    never = f" It never waited for its {'; '.join(st['unwaited'])}." if st["unwaited"] else ""
    if st["state"] == "returned":
        return f"rank {rank} had returned from the function; the others had not.{never}"
    if st["state"] == "running" and stalled:
        return (f"rank {rank} was waiting, using no CPU time, but not in a dist call "
                "the grader records (a functional or autograd collective, or one torch "
                "makes for you): see where it was, below.")
    if st["state"] == "running":
        return (f"rank {rank} was not waiting for any message: it was still running Python "
                "code (an endless loop?).")
    call, waited = st["call"], now - st["since"]
    op, peer, what = call["op"], call["peer"], call["what"]
    queued = _queued(st["behind"])
    if op in p2p_log.COLLECTIVES or op == "barrier":
        if queued:
            return f"rank {rank} waited {waited:.0f} s in dist.{op}{queued}." + never
        ranks = call.get("ranks")
        whose = "every rank" if not ranks else f"every rank of its group, {list(ranks)},"
        return f"rank {rank} waited {waited:.0f} s in dist.{op}, which {whose} must call."
    if "recv" in op:
        source = "any rank" if peer is None else f"rank {peer}"
        whose = f"{source}'s {what}" if what.startswith("chunk") else f"{what} from {source}"
        head = f"rank {rank} waited {waited:.0f} s for {whose} (dist.{op})"
    else:
        head = (f"rank {rank} waited {waited:.0f} s in dist.{op} of {_its(what)} to rank "
                f"{peer}" + ("" if queued else ", which had not posted the matching receive"))
    return head + queued + _peer_state(peer, states, stuck, op) + "." + never \
        + _held_back(st)


def _its(what) -> str:
    """The sent tensor as the rank's own: 'its chunk 1', 'elements 0:3 of its tensor';
    a tensor ``p2p_log`` describes with an article keeps it ('a 1536-element tensor')."""
    if what.startswith("chunk "):
        return f"its {what}"
    if what.endswith(" of the tensor"):
        return what.removesuffix(" of the tensor") + " of its tensor"
    return what or "a tensor"


def _held_back(st) -> str:
    """' Its dist.irecv ..., issued after it, could not start ...' (strict mode)."""
    if st["behind"] or not st["queued"]:
        return ""
    # A send held back is what its peer waits for; else the next call in line.
    later = next((c for c in st["queued"] if "send" in c["op"]), st["queued"][0])
    return (f" Its {p2p_log.call_text(later['op'], later['what'], later['peer'])}, issued "
            "after it, could not start before it completed.")


def _queued(behind) -> str:
    """', queued behind its own dist.isend of chunk 1 to rank 0' (strict mode), or ''."""
    if behind is None:
        return ""
    batched = "batched " if "batch" in behind else ""
    return (", queued behind its own earlier " + batched
            + p2p_log.call_text(behind["op"], behind["what"], behind["peer"])
            + ", which had not completed")


def _peer_state(peer, states, stuck, op) -> str:
    if peer not in states:
        return ""
    st = states[peer]
    if peer not in stuck or st["state"] == "returned":
        never = f" without waiting for its {'; '.join(st['unwaited'])}" if st["unwaited"] \
            else " without sending it" if "recv" in op else ""
        return f"; rank {peer} had already returned{never}"
    if st["state"] == "running":
        return f"; rank {peer} was busy running Python code"
    call = st["behind"] or st["call"]  # strict mode: what its queue was stuck on
    direction = "to" if "send" in call["op"] else "from"
    target = "" if call["peer"] is None else f" {direction} rank {call['peer']}"
    return f"; rank {peer} was itself blocked in dist.{call['op']}{target}"


def _deadlock_hint(states, stuck) -> str:
    if any(states[r]["behind"] or states[r]["queued"] for r in stuck):
        return ("\nUnder NCCL's rules (LABSUPPORT_P2P=strict runs gloo by them) a rank's "
                "unbatched dist.isend, dist.irecv, dist.send and dist.recv run one at a "
                "time, in the order it issued them, whatever their tags: a send completes "
                "only once its receiver has reached the matching receive. Put the sends and "
                "receives that must progress together in one dist.batch_isend_irecv.")
    if any(st["unwaited"] for st in states.values()):
        return ("\nA request nobody waits for may be dropped before its message arrives: keep "
                "what dist.isend/dist.irecv return and call .wait() on it.")
    ops = [states[r]["call"]["op"] if states[r]["call"] else None for r in stuck]
    if len(ops) > 1 and all(op in ("send", "isend") for op in ops):
        return ("\nEvery stuck rank was sending, so none reached its receive: a send waits "
                "until the receiver has posted the matching receive. Post the send and the "
                "receive of a step together, in one dist.batch_isend_irecv, then wait for "
                "both.")
    return ""
