"""What ``import labsupport`` sets up in an IPython kernel.

- the ``%%ranks`` cell magic;
- a traceback for ``RankError`` that shows the notebook's own frames and the
  ranks' story (in the error message), without the launcher's internals;
- in a Jupyter kernel, plotly's renderer for the offline book.
"""
import os
import sys
import types

from labsupport.errors import RankError

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def setup(ip):
    """Register everything with the IPython shell ``ip`` (idempotent)."""
    from labsupport import magic
    magic.load_ipython_extension(ip)
    ip.set_custom_exc((RankError,), _show_rank_error)
    if "ipykernel" in sys.modules:
        from labsupport import plots
        plots.use_book_renderer()


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
