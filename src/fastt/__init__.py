"""fastt: automatic device placement, scheduling and op splitting for training PyTorch models (FastT)."""

import contextlib as _contextlib
import os as _os
import sys as _sys


@_contextlib.contextmanager
def _start_up():
    """Loading fastt's modules (torch takes seconds). Ctrl-C meanwhile, in the `fastt` command (its script, or
    `python -m fastt.…`, whose argv[0] is "-m" while its packages load), ends it in one line with exit code
    130, as it does later on; a program that imports fastt gets its KeyboardInterrupt as usual."""
    try:
        yield
    except KeyboardInterrupt:
        if _os.path.basename((getattr(_sys, "argv", None) or [""])[0]) not in ("fastt", "-m"):
            raise
        print("fastt: interrupted (SIGINT) while starting up; nothing was started", file=_sys.stderr)
        raise SystemExit(130) from None


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
