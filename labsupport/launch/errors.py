"""Errors raised in the notebook for what went wrong on the ranks.

One exception names every failing rank and shows each remote traceback, with
the source lines of notebook cells (the kernel has them; the ranks do not).
"""
import linecache
import os
import re
import sys


class RankError(RuntimeError):
    """One or more ranks raised, died or had to be stopped.

    ``failures`` maps rank -> description of what it raised (or how it died);
    ``stacks`` maps rank -> where a rank that had to be stopped was;
    ``reason``, why ranks still running were stopped: "deadline" (wall clock),
    or, under a ``progress.WorkDeadline``, "stall", "cpu" or "ceiling" (None
    when no rank was stopped).
    """

    reason: str | None = None
    flight_recorder: dict = {}   # rank -> torch's Flight Recorder record (hangs only)

    def __init__(self, message: str, failures: dict | None = None, stacks: dict | None = None):
        super().__init__(message)
        self.failures = failures or {}
        self.stacks = stacks or {}

    @property
    def ranks(self) -> list[int]:
        """The ranks that raised or died."""
        return sorted(self.failures)

    def exception(self, rank: int):
        """The exception object rank ``rank`` raised (None if it could not be sent back)."""
        pickled = self.failures.get(rank, {}).get("pickled")
        if pickled is None:
            return None
        import cloudpickle
        try:
            return cloudpickle.loads(pickled)
        except Exception:
            return None


class RankTimeout(RankError, TimeoutError):
    """A run passed its deadline; the ranks still running were stopped."""


def build_error(failures: dict, running: list, stacks: dict, deadline: str,
                restarting: bool, extra: str = "") -> RankError:
    """One exception for the whole group: a summary line, then each rank's story
    (``extra``, if given, after the summary: the Flight Recorder's lines, ``flight``).

    Ranks with the same traceback (or stopped at the same place) share one entry.
    """
    if failures:
        head = "; ".join(f"{_ranks(ranks)} {what}"
                         for what, ranks in _group(failures, _what_happened).items())
        if running:
            head += f"; stopped {_ranks(running)}, still running"
    else:
        head = f"{_ranks(running)} still running at {deadline}; stopped"
    if restarting:
        head += " (a fresh group is starting for the next call)"
    parts = [f"--- {_ranks(ranks)} ---\n{text}".rstrip()
             for text, ranks in _group(failures, format_failure).items()]
    parts += [f"--- {_ranks(ranks)} stopped here ---\n{text}".rstrip()
              for text, ranks in _group({r: stacks.get(r, "") for r in running}, str).items()]
    if extra:
        parts.insert(0, extra.rstrip())
    cls = RankError if failures else RankTimeout
    return cls(head + "\n\n" + "\n\n".join(parts), failures, stacks)


def _what_happened(failure: dict) -> str:
    if "died" in failure:
        return f"died ({failure['died']})"
    return "raised " + failure["text"].strip().splitlines()[-1]


def _group(by_rank: dict, describe) -> dict:
    """{description: [ranks]} in rank order."""
    groups: dict = {}
    for rank in sorted(by_rank):
        groups.setdefault(describe(by_rank[rank]), []).append(rank)
    return groups


def _ranks(ranks) -> str:
    """'rank 1' or 'ranks 0, 2, 3'."""
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def format_failure(failure: dict) -> str:
    """The remote traceback of one rank, in Python's usual layout."""
    if "died" in failure:  # its last stderr (a segfault's traceback), or say there is none
        return failure.get("tail") or "(it wrote nothing to stderr before it died)"
    return "".join(_format_chain(failure))


def _format_chain(desc: dict) -> list[str]:
    lines = []
    if desc.get("cause"):
        lines += _format_chain(desc["cause"])
        lines.append("\nThe above exception was the direct cause of the following exception:\n\n")
    elif desc.get("context"):
        lines += _format_chain(desc["context"])
        lines.append("\nDuring handling of the above exception, another exception occurred:\n\n")
    frames = [f for f in desc["frames"] if not any(marker in f[0] for marker in _INTERNAL)]
    if frames:
        lines.append("Traceback (most recent call last):\n")
        lines += [format_frame(*frame) for frame in frames]
    lines.append(desc["text"] + "\n")
    return lines


def format_frame(filename: str, lineno: int, name: str) -> str:
    source = linecache.getline(filename, lineno).strip()
    where = f"  {describe_file(filename)}, line {lineno}, in {name}\n"
    return where + (f"    {source}\n" if source else "")


def describe_file(filename: str) -> str:
    """'Cell In[3]' for notebook cells; short, machine-independent paths otherwise."""
    cell = _cell_name(filename)
    if cell:
        return cell
    # Library and course files relative to where they are installed, so that the
    # same error reads the same on every machine (and in stored notebook outputs).
    if _SITE_PACKAGES in filename:
        return f'File "{filename.split(_SITE_PACKAGES, 1)[1]}"'
    for root in (_STDLIB, _COURSE_ROOT):
        if filename.startswith(root):
            return f'File "{filename[len(root):]}"'
    return f'File "{filename}"'


def _cell_name(filename: str) -> str | None:
    ip = _ipython()
    if ip is None:
        return None
    try:
        kind, number = ip.compile.format_code_name(filename) or (None, None)
    except Exception:
        return None
    return f"{kind} {number}" if kind else None


def _ipython():
    if "IPython" not in sys.modules:
        return None
    from IPython import get_ipython
    return get_ipython()


_SITE_PACKAGES = "site-packages" + os.sep
_STDLIB = os.path.dirname(os.__file__) + os.sep
_LAUNCH_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep  # .../labsupport/launch/
_COURSE_ROOT = os.path.dirname(os.path.dirname(_LAUNCH_DIR.rstrip(os.sep))) + os.sep
_FAULT_FRAME = re.compile(r'^\s*File "(.*)", line (\d+) in (.*)$')
# Frames that say nothing to the reader: the launcher's own (every file of the
# package labsupport.launch), strict mode's wrappers of torch.distributed's
# functions (labsupport/launch/strict_p2p.py), and torch's logging wrapper.
_INTERNAL = (_LAUNCH_DIR, "<frozen ", os.sep + "threading.py", "c10d_logger.py",
             os.sep + "labsupport" + os.sep + "strict_p2p.py")


GPU_STUCK = ("  (the function had returned, but an NCCL or CUDA operation it queued never "
             "completed: torch.cuda.synchronize() was still waiting for it. A collective or "
             "send/recv that the other ranks did not match, in the same order, is the usual "
             "cause; a CUDA kernel that never ends is another)\n")


def format_stack_dump(dump: str) -> str:
    """Where a stuck rank is, from faulthandler's dump: its main thread, user frames only."""
    threads = re.split(r"\n(?=(?:Current thread|Thread) 0x)", dump.strip())
    main = next((t for t in threads if "_serve" in t or "in main" in t),
                threads[0] if threads else "")
    if "in _wait_for_gpu" in main:  # rank_main: the function returned, its GPU work did not
        return GPU_STUCK
    frames = [m.groups() for m in map(_FAULT_FRAME.match, main.splitlines()) if m]
    frames = [(f, int(n), name) for f, n, name in reversed(frames)
              if not any(marker in f for marker in _INTERNAL)]
    if not frames:
        return "  (no Python frame: the rank was idle or inside the launcher)\n"
    return "".join(format_frame(*frame) for frame in frames)
