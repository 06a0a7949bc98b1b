"""The user's own code in a custom capture (``workload.entrypoint``: the file's import, its
``build(ctx)``, the ``make_batch`` and ``step`` it returns): a failure there is the user's,
told in one line that names their file, the line and the exception, never a traceback
through the recorder.

``sys.exit()`` in that code is a failure too (it would end tracefleet with nothing said);
``KeyboardInterrupt`` (a signal) and a bound's alarm (actors/time_limit.py) pass through.
"""
from __future__ import annotations

import functools
import os
import sys
import traceback
from typing import Callable

from actors.errors import ConfigError, TracefleetError


# what a capture's step cannot do wherever it runs, told with what to do instead
_HINTS = (
    (("not linked with support for cuda", "Torch not compiled with CUDA enabled"),
     "; a capture runs the step on the device tracefleet gives it, ctx.device (on fake, its "
     "tensors stand for the target GPU's): put modules and tensors there, not on cuda"),
)


def _hint(message: str) -> str:
    return next((hint for needles, hint in _HINTS if any(n in message for n in needles)), "")


def failure_text(exc: BaseException, path: str | None) -> str:
    """``ValueError: boom at /x/step.py:12 in step``: the exception and the innermost frame
    in the user's file ``path`` (else the innermost frame of all), with what to do instead
    where the failure is a known one."""
    frames = traceback.extract_tb(exc.__traceback__)
    own = [f for f in frames if path and os.path.abspath(f.filename) == path]
    frame = (own or frames or [None])[-1]
    place = f" at {frame.filename}:{frame.lineno} in {frame.name}" if frame else ""
    if isinstance(exc, SystemExit):
        return f"called sys.exit({exc.code!r}){place}"
    text = str(exc).strip().splitlines()
    first = text[0] if text else "(no message)"
    return f"raised {type(exc).__name__}: {first}{place}{_hint(first)}"


def user_file(spec: str) -> str | None:
    """The absolute file of a ``PATH.py:FUNCTION`` entrypoint, or of an imported
    ``MODULE:FUNCTION`` one's module (None when it has none)."""
    target = spec.rpartition(":")[0]
    if target.endswith(".py"):
        return os.path.abspath(os.path.expanduser(target))
    module_file = getattr(sys.modules.get(target), "__file__", None)
    return os.path.abspath(module_file) if module_file else None


def guarded(fn: Callable, what: str, prefix: str, path: str | None, where: str = "") -> Callable:
    """``fn`` whose failures (an exception, ``sys.exit``) become a ConfigError
    ``<prefix>: <what> raised <Type>: <message> at <file>:<line> in <function> <where>``;
    project errors pass through as they are."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except TracefleetError:
            raise
        except (Exception, SystemExit) as exc:  # noqa: BLE001 (the user's code: any failure)
            raise ConfigError(f"{prefix}: {what} {failure_text(exc, path)}"
                              + (f" {where}" if where else "")) from exc
    return call
