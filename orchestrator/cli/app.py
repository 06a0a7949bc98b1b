"""What the console scripts share: user errors as one line, tracebacks only with --debug."""
from __future__ import annotations

import sys
from contextlib import contextmanager

from actors.errors import TracefleetError

DEBUG_FLAG = "--debug"
USER_ERROR_EXIT = 2
_debug = False  # set by run_app from the command line
_task_started = False  # set when Hydra has composed the config and runs the task


def pop_debug_flag(argv: list[str]) -> bool:
    """Remove ``--debug`` from argv (Hydra would reject it); True when it was there."""
    if DEBUG_FLAG not in argv:
        return False
    argv[:] = [a for a in argv if a != DEBUG_FLAG]
    return True


def debugging() -> bool:
    """Whether ``--debug`` was given: user errors then raise with their traceback."""
    return _debug


def run_app(app) -> None:
    """Console-script body: take ``--debug`` off argv (Hydra would reject it), run ``app``.

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
    """Print a TracefleetError as ``prog: error: ...`` and exit 2; re-raise under --debug."""
    global _task_started
    _task_started = True
    try:
        yield
    except TracefleetError as e:
        if _debug:
            raise
        print(f"{prog}: error: {e}", file=sys.stderr)
        sys.exit(USER_ERROR_EXIT)
