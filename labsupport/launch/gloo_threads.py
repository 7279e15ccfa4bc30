"""gloo's TCP event-loop threads one step behind the rank's own threads (Linux).

gloo's TCP transport gives each process group an event-loop thread
(``gloo_tcp_loop``, one per group's device). When a socket is ready it handles
the event only if it can take that connection's lock at once; otherwise it
returns to ``epoll_wait``, which is level-triggered and reports the same event
again at once (gloo/transport/tcp/pair.cc, ``Pair::handleEvents``: "attempt to
lock the pair and skip handling the events until the next tick if the lock
cannot be acquired"). So while a rank's own thread holds the lock, the loop
spins; on cores shared by more ranks than there are cores (4 ranks on the
course's 2), the spinning loops take the cores from the threads they wait
for. perf on 4 plain torch + gloo ranks passing 1 KiB round a ring put 67% of
all CPU samples in ``gloo_tcp_loop``, nearly all of them in ``epoll_wait``.

At nice ``NICE`` a loop thread still runs at once on an idle core, and
handles its events exactly as before; on a busy core it yields to the rank's
threads (the kernel's weights, kernel/sched/core.c ``sched_prio_to_weight``:
110 at nice 10 against 1024 at nice 0).
Threads inherit their creator's nice, and a thread may raise its own nice
but never lower it back, so the loops are found by name after each group is
made: ``install`` wraps c10d's ``_new_process_group_helper``, which
``init_process_group``, ``new_group`` and a DeviceMesh's groups go through.
Nothing changes where Linux's /proc is missing or the call is refused.
"""
import glob
import os

import torch.distributed.distributed_c10d as c10d

LOOP = "gloo_tcp_loop"  # the thread name gloo gives its event loop
NICE = 10
_state = {"installed": False}


def lower_loop_priority() -> int:
    """Set this process's gloo loop threads that run below nice ``NICE`` to it;
    return how many were changed."""
    changed = 0
    for comm in glob.glob("/proc/self/task/*/comm"):
        try:
            with open(comm) as f:
                if f.read().strip() != LOOP:
                    continue
            tid = int(comm.split("/")[-2])
            if os.getpriority(os.PRIO_PROCESS, tid) < NICE:
                os.setpriority(os.PRIO_PROCESS, tid, NICE)
                changed += 1
        except OSError:  # the thread has ended, or the system refuses: gloo as it is
            continue
    return changed


def install():
    """Lower the loop threads now and after every process group made from here on."""
    if _state["installed"] or not os.path.isdir("/proc/self/task"):
        return
    original = c10d._new_process_group_helper

    def _new_process_group_helper(*args, **kwargs):
        try:
            return original(*args, **kwargs)
        finally:
            lower_loop_priority()
    _new_process_group_helper.__wrapped__ = original
    c10d._new_process_group_helper = _new_process_group_helper
    _state["installed"] = True
    lower_loop_priority()
