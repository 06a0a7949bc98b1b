"""``workload.model=custom`` (preset ``workload=custom``): the user's own training step, loaded from ``workload.entrypoint``.

The entrypoint is ``PATH.py:FUNCTION`` (a file, loaded by path) or ``package.module:FUNCTION``
(imported). The contract::

    def build(ctx):   # ctx: actors.capture.workloads.context.CaptureContext
        # ctx.device: the torch.device the model lives on; ctx.rank, ctx.world_size: ints;
        # ctx.mesh: a 1-D DeviceMesh over all ranks, created by the caller; the default
        # process group is initialized before build() is called.
        return model, make_batch, step
        # make_batch() -> a batch on ctx.device; step(batch) runs ONE whole training
        # iteration (forward, backward, gradient communication, optimizer step, zero_grad).

Loading the file runs the user's own code (it is their config, as a training script is).
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from typing import Callable

import torch.nn as nn

from actors.capture import user_code
from actors.capture.workloads.context import CaptureContext, Workload
from actors.capture.environment_reads import environment_of, environment_reads, note_reads
from actors.errors import ConfigError

KEY = "workload.entrypoint"
_LOADED = "__tracefleet_loaded__"  # a loaded file's (sha256, {variable its import read: value})
FORM = "PATH.py:FUNCTION or package.module:FUNCTION"


def _split(spec: str) -> tuple[str, str]:
    target, sep, attr = (spec or "").rpartition(":")
    if not sep or not target or not attr.isidentifier():
        raise ConfigError(f"{KEY}={spec!r}: expected {FORM} (e.g. examples/ddp_step.py:build)")
    return target, attr


def resolve_entrypoint(spec: str) -> str:
    """``spec`` with a file made absolute (ranks may run in another directory); ConfigError
    when the form is wrong or the file does not exist."""
    target, attr = _split(spec)
    if not target.endswith(".py"):
        return spec
    path = os.path.abspath(os.path.expanduser(target))
    if not os.path.isfile(path):
        raise ConfigError(f"{KEY}={spec!r}: no such file {path}")
    return f"{path}:{attr}"


def load_build(spec: str) -> Callable:
    """The entrypoint's function: the file loaded by path or the module imported."""
    target, attr = _split(spec)
    if target.endswith(".py"):
        path = os.path.abspath(os.path.expanduser(target))
        if not os.path.isfile(path):
            raise ConfigError(f"{KEY}={spec!r}: no such file {path}")
        # One module per file, named from its path: the same file loaded twice is one module,
        # loaded again only when the file or a variable its import read has changed since
        name = f"tracefleet_entrypoint_{hashlib.sha256(path.encode()).hexdigest()[:12]}"
        module = sys.modules.get(name)
        if module is None or _stale(module, path):
            module = _load_file(name, path, spec)
        note_reads(getattr(module, _LOADED)[1])  # its import's reads belong to this capture
    else:
        try:
            module = importlib.import_module(target)
        except (Exception, SystemExit) as e:
            raise ConfigError(f"{KEY}={spec!r}: importing {target} "
                              f"{user_code.failure_text(e, None)}") from e
    build = getattr(module, attr, None)
    if not callable(build):
        raise ConfigError(f"{KEY}={spec!r}: {target} has no function {attr!r}"
                          + ("" if build is None else f" (found a {type(build).__name__})"))
    return build


def _file_sha(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _stale(module, path: str) -> bool:
    """Whether the file or a variable its import read changed since it was loaded."""
    sha, environment = getattr(module, _LOADED, (None, {}))
    return sha != _file_sha(path) or environment_of(environment) != environment


def _load_file(name: str, path: str, spec: str):
    """The file executed as module ``name`` (in sys.modules), with what it was loaded from."""
    loader_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[name] = module
    sha = _file_sha(path)
    try:
        with environment_reads() as names:
            loader_spec.loader.exec_module(module)
    except (Exception, SystemExit) as e:
        del sys.modules[name]
        raise ConfigError(f"{KEY}={spec!r}: loading {path} "
                          f"{user_code.failure_text(e, path)}") from e
    setattr(module, _LOADED, (sha, environment_of(names)))
    return module


def build_custom(spec: str, ctx: CaptureContext) -> Workload:
    """Call the entrypoint's ``build(ctx)`` and wrap what it returns into a Workload."""
    build = load_build(spec)
    try:
        built = build(ctx)
    except ConfigError as e:  # e.g. a model the device cannot run (DDP on fake)
        raise ConfigError(f"{KEY}={spec!r}: {e}") from e
    except (Exception, SystemExit) as e:
        raise ConfigError(f"{KEY}={spec!r}: build(ctx) "
                          f"{user_code.failure_text(e, user_code.user_file(spec))} "
                          f"(rank {ctx.rank} of {ctx.world_size}, device {ctx.device})") from e
    if not isinstance(built, (tuple, list)) or len(built) != 3:
        got = f"a {type(built).__name__}" + (f" of {len(built)}" if isinstance(built, (tuple, list))
                                               else "")
        raise ConfigError(f"{KEY}={spec!r}: build(ctx) must return (model, make_batch, step); "
                          f"got {got}")
    model, make_batch, step = built
    if not isinstance(model, nn.Module):
        raise ConfigError(f"{KEY}={spec!r}: build(ctx)'s model must be a torch.nn.Module; "
                          f"got a {type(model).__name__}")
    for name, fn in (("make_batch", make_batch), ("step", step)):
        if not callable(fn):
            raise ConfigError(f"{KEY}={spec!r}: build(ctx)'s {name} must be callable; got a "
                              f"{type(fn).__name__}")
    # Under FSDP2 a parameter is a DTensor whose numel is the full (unsharded) parameter's.
    num_params = sum(p.numel() for p in model.parameters())
    # a failure in them names the user's file and line, not the recorder's (user_code.py)
    where = f"(rank {ctx.rank} of {ctx.world_size}, device {ctx.device})"
    step, make_batch = (user_code.guarded(fn, what, f"{KEY}={spec!r}", user_code.user_file(spec),
                                          where)
                        for fn, what in ((step, "step(batch)"), (make_batch, "make_batch()")))
    return Workload(model=model, step=step, next_batch=make_batch, num_params=num_params,
                    info={"entrypoint": spec})
