"""torch.profiler on the ranks, for chapter 3's trace beside its own timeline.

    with profiling.quiet_stderr(), torch.profiler.profile() as prof:
        ...                                   # one training step
    prof.export_chrome_trace(path)            # open it in https://ui.perfetto.dev
    spans = profiling.spans(prof)             # [(name, start_us, end_us), ...]

Kineto, the profiler's C++ backend, writes a line to the process's standard
error (file descriptor 2) each time a profile starts and stops, with the time
and the process id; on the ranks that would land in the notebook's output.
``quiet_stderr`` sends descriptor 2 to /dev/null for the block.
"""
import contextlib
import os
import sys


@contextlib.contextmanager
def quiet_stderr():
    """Discard what is written to file descriptor 2 (C++ logs) during the block."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def spans(prof) -> list[tuple]:
    """Every recorded CPU event as (name, start, end), in microseconds, by start."""
    found = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()]
    return sorted(found, key=lambda span: span[1])
