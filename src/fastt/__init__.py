"""fastt: automatic device placement, scheduling and op splitting for training PyTorch models (FastT)."""

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
