"""``%%ranks``: run a cell on every rank, so a lab reads like a torchrun script, cell by cell.

    %%ranks -n 4
    x = torch.full((2,), float(rank))     # rank, world_size, device, dist, torch are defined
    dist.all_reduce(x)
    x                                     # a final expression comes back as a list by rank

Each rank keeps its own namespace between ``%%ranks`` cells until its group
is restarted: after any error on a rank (a half-finished exchange would
corrupt the next run), a timeout, an interrupt, or a new ``ls.start``.
"""
import sys

from IPython.core.error import UsageError
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from labsupport import launcher


@magic_arguments()
@argument("-n", "--world-size", type=int, default=None,
          help="number of ranks; starts a group when none with this size is running")
@argument("-t", "--timeout", type=float, default=None, help="deadline of this cell in seconds")
@argument("--stream", action="store_true", help="show output lines as they arrive")
def ranks(line, cell):
    """Run this cell on every rank of the running group (see ``labsupport.magic``)."""
    opts = parse_argstring(ranks, line)
    cluster = _cluster(opts.world_size)
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


def _cluster(world_size):
    cluster = launcher.current()
    if world_size is not None and (cluster is None or cluster.world_size != world_size):
        return launcher.start(world_size)
    if cluster is None:
        raise UsageError("no group of ranks is running: start one with "
                         "ls.start(world_size=4), or write %%ranks -n 4")
    return cluster


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


def load_ipython_extension(ip):
    ip.register_magic_function(ranks, "cell", "ranks")
