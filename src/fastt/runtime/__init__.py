"""Running plans for real: `parallelize` returns a step callable backed by the local runtime (`step.py`); the
plan it runs is chosen by `decide.py`, the sequence the distributed runtime shares, and the `fastt` planner's
plan is raced against data parallelism (and, on CPU, one device with every core) by `trial.py`, as the
distributed runtime's is against data parallelism."""

from ..cost import measure_step
from .decide import Decision, decide
from .local import StepError
from .programs import Placed
from .step import ParallelStep, PlacedStep, busy_devices, parallelize
from .tune import Tuner

__all__ = ["Decision", "ParallelStep", "Placed", "PlacedStep", "StepError", "Tuner", "busy_devices", "decide",
           "measure_step", "parallelize"]
