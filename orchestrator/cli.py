"""What the console scripts share: user errors as one line, tracebacks only with --debug."""
from __future__ import annotations

import sys
from contextlib import contextmanager

from actors.errors import TracefleetError

DEBUG_FLAG = "--debug"
_debug = False  # set by run_app from the command line


def pop_debug_flag(argv: list[str]) -> bool:
    """Remove ``--debug`` from argv (Hydra would reject it); True when it was there."""
    if DEBUG_FLAG not in argv:
        return False
    argv[:] = [a for a in argv if a != DEBUG_FLAG]
    return True


def run_app(app) -> None:
    """Console-script body: take ``--debug`` off argv (Hydra would reject it), run ``app``."""
    global _debug
    _debug = pop_debug_flag(sys.argv)
    app()


@contextmanager
def user_errors(prog: str):
    """Print a TracefleetError as ``prog: error: ...`` and exit 2; re-raise under --debug."""
    try:
        yield
    except TracefleetError as e:
        if _debug:
            raise
        print(f"{prog}: error: {e}", file=sys.stderr)
        sys.exit(2)
