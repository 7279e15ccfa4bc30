"""What ``import labsupport`` sets up in an IPython kernel.

- the ``%%ranks`` cell magic: run a cell on every rank, so a lab reads like a
  torchrun script, cell by cell;
- a traceback for ``RankError`` that shows the notebook's own frames and the
  ranks' story (in the error message), without labsupport's internals;
- in a Jupyter kernel, plotly's renderer for the offline book.

    %%ranks -n 4
    x = torch.full((2,), float(rank))     # rank, world_size, device, dist, torch are defined
    dist.all_reduce(x)
    x                                     # a final expression comes back as a list by rank

Each rank keeps its own namespace between ``%%ranks`` cells until its group
is restarted: after any error on a rank (a half-finished exchange would
corrupt the next run), a timeout, an interrupt, or a new ``ls.start``.
"""
import os
import sys
import types

from IPython.core.error import UsageError
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from labsupport.launch import session
from labsupport.launch.errors import RankError

# labsupport/, the package: its frames are left out of the kernel's tracebacks
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def setup(ip):
    """Register everything with the IPython shell ``ip`` (idempotent)."""
    ip.register_magic_function(ranks, "cell", "ranks")
    ip.set_custom_exc((RankError,), _show_rank_error)
    if "ipykernel" in sys.modules:
        from labsupport import plots
        plots.use_book_renderer()


# -- %%ranks ----------------------------------------------------------------------------

@magic_arguments()
@argument("-n", "--world-size", type=int, default=None,
          help="number of ranks; starts a group when none with this size is running")
@argument("-t", "--timeout", type=float, default=None, help="deadline of this cell in seconds")
@argument("--stream", action="store_true", help="show output lines as they arrive")
def ranks(line, cell):
    """Run this cell on every rank of the running group (see ``labsupport.launch.ipython``)."""
    opts = parse_argstring(ranks, line)
    cluster = session.group_for(opts.world_size)
    if cluster is None:
        raise UsageError("no group of ranks is running: start one with "
                         "ls.start(world_size=4), or write %%ranks -n 4")
    source = "\n" + cell  # line numbers as seen in the cell, whose line 1 is %%ranks
    filename = _register(source)
    compile(source, filename, "exec")  # a syntax error is reported here, before any rank runs
    _warn_if_restarted(cluster)
    _last_seen[id(cluster)] = cluster.generation  # a restart during this cell shows up next time
    values = cluster.exec_cell(source, filename, timeout=opts.timeout, stream=opts.stream)
    return values if any(v is not None for v in values) else None


_last_seen: dict = {}  # id(cluster) -> generation of ranks that ran the last %%ranks cell


def _warn_if_restarted(cluster):
    seen = _last_seen.get(id(cluster))
    if seen is not None and seen != cluster.generation:
        sys.stderr.write("labsupport: these ranks were restarted since the last %%ranks cell "
                         "(after an error, a timeout or an interrupt): variables defined by "
                         "earlier %%ranks cells are gone; re-run those cells.\n")


def _register(source: str) -> str:
    """Give the cell a file name that the kernel's tracebacks know ('Cell In[7]')."""
    from IPython import get_ipython
    ip = get_ipython()
    if ip is None:
        return "<ranks-cell>"
    return ip.compile.cache(source, _cell_number(ip), raw_code=source)


def _cell_number(ip) -> int:
    """The execution count of the cell running this magic (found on the call stack)."""
    frame = sys._getframe()
    while frame is not None:
        name = ip.compile.format_code_name(frame.f_code.co_filename)
        if name and name[1].startswith("In["):
            return int(name[1][3:-1])
        frame = frame.f_back
    return max(ip.execution_count - 1, 0)  # IPython counts the running cell already


# -- tracebacks --------------------------------------------------------------------------

def _show_rank_error(shell, etype, value, tb, tb_offset=None):
    """IPython's usual traceback, minus the frames inside labsupport."""
    # What IPython's own showtraceback records, for %debug, %tb and sys.last_value
    sys.last_type, sys.last_value, sys.last_traceback = etype, value, tb
    stb = shell.InteractiveTB.structured_traceback(etype, value, without_labsupport(tb),
                                                   tb_offset=tb_offset)
    shell._showtraceback(etype, value, stb)
    return stb


def without_labsupport(tb):
    """The traceback chain with labsupport's own frames left out."""
    frames = []
    while tb is not None:
        if not tb.tb_frame.f_code.co_filename.startswith(_PACKAGE_DIR):
            frames.append(tb)
        tb = tb.tb_next
    rebuilt = None
    for frame_tb in reversed(frames):
        rebuilt = types.TracebackType(rebuilt, frame_tb.tb_frame, frame_tb.tb_lasti,
                                      frame_tb.tb_lineno)
    return rebuilt
