"""Workloads: what a model spec names, a zoo model or `path/to/file.py:function` returning (model, loss_fn,
optimizer, example_inputs); the CLI and the launcher both load them."""

from __future__ import annotations

import importlib.util
import inspect
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


def model_name(spec: str) -> str:
    """What tables call a model: its zoo name, or `file_stem:function` of a file spec (not the whole path)."""
    if not is_file_spec(spec):
        return spec
    path, fn_name = spec.rsplit(":", 1)
    return f"{Path(path).stem}:{fn_name}"


def load_workload(spec: str, size: str, batch: int | None, optimizer: str | None) -> tuple:
    """(name, model, loss_fn, optimizer, example_inputs) of a zoo model, or of `path/to/file.py:function`
    returning (model, loss_fn, optimizer, example_inputs). `batch` and `optimizer` (None: the default) go to a
    file's function as keyword arguments of those names; a FasttError if it takes no such argument, so that an
    option is never silently ignored."""
    check_models([spec])
    if is_file_spec(spec):
        options = {k: v for k, v in (("batch", batch), ("optimizer", optimizer)) if v is not None}
        return (model_name(spec), *_workload_of(spec, call_file(spec, **options)))
    from . import zoo

    w = zoo.get(spec, size, batch=batch, optimizer=optimizer or "sgd", dropout=False)
    return spec, w.model, w.loss_fn, w.optimizer, w.example_inputs


def _workload_of(spec: str, got: object) -> tuple:
    """`got` as (model, loss_fn, optimizer, example_inputs),
    or a FasttError saying what the function returned."""
    import torch

    want = "it must return (model, loss_fn, optimizer, example_inputs)"
    if not isinstance(got, (tuple, list)) or len(got) != 4:
        what = (f"{len(got)} items" if isinstance(got, (tuple, list))
                else f"an object of type {type(got).__name__}")
        raise FasttError(f"{spec} returned {what}: {want}")
    model, loss_fn, opt, inputs = got
    wrong = [f"{name} is of type {type(x).__name__}" for name, x, ok in (
        ("model", model, isinstance(model, torch.nn.Module)), ("loss_fn", loss_fn, callable(loss_fn)),
        ("optimizer", opt, isinstance(opt, torch.optim.Optimizer)),
        ("example_inputs", inputs, isinstance(inputs, (tuple, list)) and len(inputs) > 0
         and all(isinstance(x, torch.Tensor) for x in inputs))) if not ok]
    if wrong:
        raise FasttError(f"{spec} returned a wrong item ({wrong[0]}): {want}, a torch.nn.Module, a callable, "
                         "a torch.optim.Optimizer and a non-empty tuple of tensors (the model's inputs, then "
                         "the target)")
    return model, loss_fn, opt, tuple(inputs)


def call_file(spec: str, **options: object) -> object:
    """What the function of `path/to/file.py:function` returns, called with `options` as keyword arguments; a
    FasttError naming the spec if it raises, or if it takes none of those keywords."""
    path, fn_name = spec.rsplit(":", 1)
    if not is_file_spec(spec) or not Path(path).is_file():
        raise FasttError(f"{spec}: not path/to/file.py:function of an existing file")
    mod_spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    module = importlib.util.module_from_spec(mod_spec)
    try:
        mod_spec.loader.exec_module(module)
    except Exception as e:
        raise FasttError(f"{spec}: importing {path} failed: {type(e).__name__}: {e}".splitlines()[0]) from e
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise FasttError(f"{spec}: {path} has no function {fn_name!r}")
    for key, value in options.items():
        if not _takes(fn, key):
            raise FasttError(f"--{key} {value}: {fn_name}() in {path} takes no {key!r} keyword argument; add "
                             f"one (def {fn_name}({key}=...)) or leave out --{key}")
    try:
        return fn(**options)
    except FasttError:
        raise
    except Exception as e:
        raise FasttError(f"{spec} failed: {type(e).__name__}: {e}".splitlines()[0]) from e


def _takes(fn: object, key: str) -> bool:
    """Whether fn accepts keyword argument `key` (by name, or through **kwargs)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == key and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
               or p.kind == p.VAR_KEYWORD
               for p in params)
