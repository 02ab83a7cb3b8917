"""Workloads: what a model spec names, a zoo model or `path/to/file.py:function` returning (model, loss_fn,
optimizer, example_inputs); the CLI and the launcher both load them."""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path

from .errors import FasttError


def is_file_spec(spec: str) -> bool:
    """Whether `spec` is `path/to/file.py:function` (else a zoo name)."""
    return ":" in spec and spec.split(":")[0].endswith(".py")


def check_models(specs: Sequence[str]) -> None:
    """Fail fast, before any long capture, on a model that is neither in the zoo nor a file."""
    from .zoo import NAMES

    for spec in specs:
        if is_file_spec(spec):
            if not Path(spec.rsplit(":", 1)[0]).is_file():
                raise FasttError(f"model file {spec.rsplit(':', 1)[0]} not found")
        elif spec not in NAMES:
            raise FasttError(f"unknown model '{spec}': use a zoo model ({', '.join(NAMES)}) or "
                             "path/to/file.py:function")


def load_workload(spec: str, size: str, batch: int | None, optimizer: str) -> tuple:
    """(name, model, loss_fn, optimizer, example_inputs) of a zoo model, or of `path/to/file.py:function`
    returning (model, loss_fn, optimizer, example_inputs)."""
    check_models([spec])
    if is_file_spec(spec):
        return (Path(spec.rsplit(":", 1)[0]).stem, *call_file(spec))
    from . import zoo

    w = zoo.get(spec, size, batch=batch, optimizer=optimizer, dropout=False)
    return spec, w.model, w.loss_fn, w.optimizer, w.example_inputs


def call_file(spec: str) -> object:
    """What the function of `path/to/file.py:function` returns; a FasttError naming the spec if it raises."""
    path, fn_name = spec.rsplit(":", 1)
    if not is_file_spec(spec) or not Path(path).is_file():
        raise FasttError(f"{spec}: not path/to/file.py:function of an existing file")
    mod_spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    module = importlib.util.module_from_spec(mod_spec)
    try:
        mod_spec.loader.exec_module(module)
        return getattr(module, fn_name)()
    except FasttError:
        raise
    except Exception as e:
        raise FasttError(f"{spec} failed: {type(e).__name__}: {e}".splitlines()[0]) from e
