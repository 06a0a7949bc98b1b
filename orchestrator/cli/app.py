"""What the console scripts share: user errors as one line, tracebacks only with --debug.

Every entry point reports a user error the same way: ``<prog>: error: <message>`` on stderr
and exit status ``USER_ERROR_EXIT`` (2); with ``--debug`` the traceback is printed first.
Hydra apps go through ``run_app`` and wrap their task in ``user_errors``; argparse ones
return ``guarded(...)``. A user error is a TracefleetError, an OSError (a path that cannot be
read or written: an output dir under a file, in ``/proc``), or, before the task starts, a
config Hydra cannot compose (an unknown group value, a typo in a key, ``world_size=abc``):
Hydra would print that in several lines and exit 1. SIGINT and SIGTERM stop every command
the same way too (orchestrator/interrupts.py): its cleanup runs, then one line and exit
``128 + signal`` (130, 143).
"""
from __future__ import annotations

import os
import sys
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

from actors.errors import TracefleetError, describe
from orchestrator.errors import USER_ERROR_EXIT
from orchestrator.interrupts import name_of, signal_of, stop_on_signals

DEBUG_FLAG = "--debug"
_FULL_ERROR_ENV = "HYDRA_FULL_ERROR"  # Hydra raises instead of printing (and exiting 1)
RUN_DIR_RESOLVER = "tracefleet_run_dir"  # conf/*.yaml: hydra.run.dir
DEFECT_EXIT = 1  # an exception no user input explains: a defect, shown with its traceback
_MAX_RUN_DIR_SUFFIX = 1000
_debug = False  # set by run_app from the command line
_task_started = False  # set when Hydra has composed the config and runs the task


def pop_debug_flag(argv: list[str]) -> bool:
    """Remove ``--debug`` from argv (Hydra would reject it); True when it was there."""
    if DEBUG_FLAG not in argv:
        return False
    argv[:] = [a for a in argv if a != DEBUG_FLAG]
    return True


def debugging() -> bool:
    """Whether ``--debug`` was given to a Hydra app (see ``run_app``)."""
    return _debug


def print_user_error(prog: str, message) -> None:
    """The one line a user error gets: ``prog: error: message`` on stderr."""
    print(f"{prog}: error: {message}", file=sys.stderr)


def user_error_status(prog: str, exc: BaseException, debug: bool) -> int:
    """Report ``exc`` as a user error of ``prog`` (its traceback first under ``debug``);
    returns ``USER_ERROR_EXIT``."""
    if debug:
        traceback.print_exception(exc)
    print_user_error(prog, _os_error_line(exc) if isinstance(exc, OSError) else exc)
    return USER_ERROR_EXIT


def interrupted_status(prog: str, exc: KeyboardInterrupt) -> int:
    """One line for a run a signal stopped (what it left behind, from the exception's notes);
    returns the shell's exit status for it, ``128 + signal``."""
    notes = "; ".join(getattr(exc, "__notes__", ()))
    print(f"{prog}: interrupted by {name_of(exc)}" + (f": {notes}" if notes else ""),
          file=sys.stderr)
    return 128 + signal_of(exc)


def guarded(prog: str, body: Callable[[], int], debug: bool,
            also: tuple[type[BaseException], ...] = ()) -> int:
    """``body()``'s exit status, or ``USER_ERROR_EXIT`` after reporting a TracefleetError
    (or one of ``also``, e.g. OSError for a path the user named) it raised; ``128 + signal``
    after SIGINT or SIGTERM."""
    try:
        with stop_on_signals():
            return body()
    except (TracefleetError, *also) as exc:
        return user_error_status(prog, exc, debug)
    except KeyboardInterrupt as exc:
        return interrupted_status(prog, exc)


def run_app(app, prog: str | None = None) -> None:
    """Console-script body of a Hydra app: take ``--debug`` off argv, run ``app``.

    Errors before the task starts (Hydra cannot compose the config, the run dir cannot be
    made) are user errors: one line, exit 2. An exception the task let through is a defect:
    its traceback, then one line, exit 1. A signal: one line, ``128 + signal``.
    """
    global _debug
    prog = prog or os.path.basename(sys.argv[0])
    user_full_error = os.environ.get(_FULL_ERROR_ENV)
    _debug = pop_debug_flag(sys.argv) or bool(user_full_error)
    register_run_dir_resolver()
    os.environ[_FULL_ERROR_ENV] = "1"
    try:
        with stop_on_signals():
            app()
    except SystemExit as e:
        if e.code == 1 and not _task_started:
            sys.exit(USER_ERROR_EXIT)
        raise
    except KeyboardInterrupt as exc:
        sys.exit(interrupted_status(prog, exc))
    except Exception as exc:  # noqa: BLE001 (a user error or a defect: told apart here)
        if _task_started and not isinstance(exc, (TracefleetError, OSError)):
            traceback.print_exception(exc)
            print(f"{prog}: internal error: {describe(exc)} (a defect: please report it with "
                  "the traceback above)", file=sys.stderr)
            sys.exit(DEFECT_EXIT)
        if _debug:
            traceback.print_exception(exc)
        print_user_error(prog, compose_error_line(exc) if not _task_started
                         else _os_error_line(exc) if isinstance(exc, OSError) else exc)
        sys.exit(USER_ERROR_EXIT)
    finally:
        if user_full_error is None:
            os.environ.pop(_FULL_ERROR_ENV, None)
        else:
            os.environ[_FULL_ERROR_ENV] = user_full_error


@contextmanager
def user_errors(prog: str):
    """Around a Hydra task: a TracefleetError or OSError is reported (``user_error_status``)
    and exits."""
    global _task_started
    _task_started = True
    try:
        yield
    except (TracefleetError, OSError) as exc:
        sys.exit(user_error_status(prog, exc, _debug))


def compose_error_line(exc: BaseException) -> str:
    """One line for an error raised before the task: Hydra's composition messages (several
    lines, plus the OmegaConf error they wrap) folded, or the run dir that cannot be made."""
    os_error = _os_error_in(exc)
    if os_error is not None:
        return (f"{_os_error_line(os_error)} (the run's output folder: give a writable one with "
                "hydra.run.dir=DIR, or hydra.sweep.dir=DIR with --multirun)")
    texts = [str(exc)]
    if exc.__cause__ is not None and str(exc.__cause__) not in texts[0]:
        texts.append(str(exc.__cause__))
    parts: list[str] = []
    items: list[str] | None = None  # the tab-indented entries of a "heading:" line
    for text in texts:
        for raw in text.splitlines():
            line = raw.strip().rstrip(".")
            if not line or line.startswith(("full_key:", "reference_type=", "object_type=",
                                            "See https://")):
                continue
            if items is not None and raw.startswith(("\t", "  ")):
                if line != "schema":  # the ConfigStore schema of every group, not a choice
                    items.append(line)
                continue
            items = None
            if line.endswith(":"):
                if line.startswith("Config search path"):
                    items = []  # swallowed: where Hydra looked, not what went wrong
                    continue
                items = []
                parts.append([line, items])
            else:
                parts.append(line)
    out = [f"{p[0]} {', '.join(p[1])}" if isinstance(p, list) else p for p in parts]
    return "; ".join(out) or type(exc).__name__


def _os_error_in(exc: BaseException) -> OSError | None:
    """The OSError ``exc`` is or was caused by (Hydra's own errors subclass OSError)."""
    from hydra.errors import HydraException

    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, OSError) and not isinstance(exc, HydraException):
            return exc
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return None


def _os_error_line(exc: OSError) -> str:
    """``cannot use <path>: <reason>`` (the path and the system's reason, no errno noise)."""
    where = exc.filename if exc.filename is not None else ""
    reason = exc.strerror or str(exc)
    return f"cannot use {where}: {reason}" if where else f"{type(exc).__name__}: {reason}"


def unique_run_dir(path: str) -> str:
    """``path`` made here, or ``path-1``, ``path-2``, ... when it exists: two runs started in
    the same second never share a run dir (the timestamp names it). ``mkdir`` without
    ``exist_ok`` claims a name atomically, so concurrent runs cannot pick the same one."""
    base = Path(path)
    base.parent.mkdir(parents=True, exist_ok=True)
    for k in range(_MAX_RUN_DIR_SUFFIX):
        candidate = base if k == 0 else base.with_name(f"{base.name}-{k}")
        try:
            candidate.mkdir()
            return str(candidate)
        except FileExistsError:
            continue
    raise FileExistsError(17, f"{_MAX_RUN_DIR_SUFFIX} run dirs of this second exist already",
                          str(base))


def register_run_dir_resolver() -> None:
    """``${tracefleet_run_dir:...}`` for conf/*.yaml's ``hydra.run.dir`` (cached: Hydra
    resolves the run dir more than once, and each call of `unique_run_dir` claims a dir)."""
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver(RUN_DIR_RESOLVER):
        OmegaConf.register_new_resolver(RUN_DIR_RESOLVER, unique_run_dir, use_cache=True)
