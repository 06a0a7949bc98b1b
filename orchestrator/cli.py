"""What the console scripts share: user errors as one line, tracebacks only with --debug."""
from __future__ import annotations

import sys
from contextlib import contextmanager

from actors.errors import TracefleetError

DEBUG_FLAG = "--debug"


def pop_debug_flag(argv: list[str]) -> bool:
    """Remove ``--debug`` from argv (Hydra would reject it); True when it was there."""
    if DEBUG_FLAG not in argv:
        return False
    argv[:] = [a for a in argv if a != DEBUG_FLAG]
    return True


@contextmanager
def user_errors(prog: str, debug: bool):
    """Print a TracefleetError as ``prog: error: ...`` and exit 2; re-raise under --debug."""
    try:
        yield
    except TracefleetError as e:
        if debug:
            raise
        print(f"{prog}: error: {e}", file=sys.stderr)
        sys.exit(2)
