"""What the console scripts share: user errors as one line, tracebacks only with --debug.

Every entry point reports a user error the same way: ``<prog>: error: <message>`` on stderr
and exit status ``USER_ERROR_EXIT`` (2); with ``--debug`` the traceback is printed first.
Hydra apps wrap their task in ``user_errors``; argparse ones return ``guarded(...)``.
"""
from __future__ import annotations

import sys
import traceback
from contextlib import contextmanager
from typing import Callable

from actors.errors import TracefleetError
from orchestrator.errors import USER_ERROR_EXIT

DEBUG_FLAG = "--debug"
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
    print_user_error(prog, exc)
    return USER_ERROR_EXIT


def guarded(prog: str, body: Callable[[], int], debug: bool,
            also: tuple[type[BaseException], ...] = ()) -> int:
    """``body()``'s exit status, or ``USER_ERROR_EXIT`` after reporting a TracefleetError
    (or one of ``also``, e.g. OSError for a path the user named) it raised."""
    try:
        return body()
    except (TracefleetError, *also) as exc:
        return user_error_status(prog, exc, debug)


def run_app(app) -> None:
    """Console-script body of a Hydra app: take ``--debug`` off argv, run ``app``.

    Hydra reports a config it cannot compose (a typo in a choice, an unknown key) and exits
    1 before the task starts; that is a user error, so it exits 2 like the others.
    """
    global _debug
    _debug = pop_debug_flag(sys.argv)
    try:
        app()
    except SystemExit as e:
        if e.code == 1 and not _task_started:
            sys.exit(USER_ERROR_EXIT)
        raise


@contextmanager
def user_errors(prog: str):
    """Around a Hydra task: a TracefleetError is reported (``user_error_status``) and exits."""
    global _task_started
    _task_started = True
    try:
        yield
    except TracefleetError as exc:
        sys.exit(user_error_status(prog, exc, _debug))
