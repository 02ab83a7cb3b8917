"""fastt: automatic device placement, scheduling and op splitting for training PyTorch models (FastT)."""

import contextlib as _contextlib
import os as _os
import signal as _signal
import sys as _sys


@_contextlib.contextmanager
def _start_up():
    """Loading fastt's modules (torch takes seconds). Ctrl-C meanwhile, in the `fastt` command (its script, or
    `python -m fastt.…`, whose argv[0] is "-m" while its packages load), ends it in one line with exit code
    130, as it does later on; a program that imports fastt gets its KeyboardInterrupt as usual. The command's
    handler exits at once rather than raise: a KeyboardInterrupt raised while Python runs a finaliser during
    torch's import is printed and dropped, and the command then ran to its end with exit code 0."""
    command = _os.path.basename((getattr(_sys, "argv", None) or [""])[0]) in ("fastt", "-m")
    if not command or _signal.getsignal(_signal.SIGINT) is not _signal.default_int_handler:
        yield  # not the command, or SIGINT ignored or handled by whoever started it: left as it is
        return

    def stop(signum, frame):
        _sys.stderr.write("fastt: interrupted (SIGINT) while starting up; nothing was started\n")
        _sys.stderr.flush()
        _os._exit(130)  # nothing was started: no child, no file, nothing to clean up
    try:
        previous = _signal.signal(_signal.SIGINT, stop)
    except ValueError:  # imported outside the main thread: no handler can be set there
        yield
        return
    try:
        yield
    finally:
        _signal.signal(_signal.SIGINT, previous)


with _start_up():
    from . import checkpoint
    from .api import capture, lower_bound, measure, plan, simulate
    from .cluster import Cluster, cluster
    from .errors import FasttError
    from .graph import Op, OpGraph
    from .strategy import Strategy

__all__ = [
           "Cluster",
           "FasttError",
           "Op",
           "OpGraph",
           "Strategy",
           "capture",
           "checkpoint",
           "cluster",
           "lower_bound", "measure",
           "plan",
           "simulate",
]
