"""A bound on code that runs in this process and may never return: a user's training step
captured on meta or fake (no Ray actor to kill there), stopped at ``capture_timeout_s``.

``time_limit(seconds, key)`` arms ``SIGALRM`` (a real-time interval timer) in the main
thread; when it fires, its handler raises a ``BaseException`` in whatever Python code runs
(a loop, ``time.sleep``, a lock or queue wait: all return to the interpreter on a signal), so
the user's ``except Exception`` cannot swallow it, and every ``finally`` on the way out runs;
an import in progress is let finish first, for up to 30 s (a module cut off mid-import would
stay broken in ``sys.modules``).
The block then raises `TimeLimitError` naming the key, the bound and where the code was
stopped (its innermost frame). Code stuck inside one C call that never returns to Python is
stopped when it does. Off the main thread (signals cannot be handled there) the block runs
unbounded.
"""
from __future__ import annotations

import signal
import threading
import time
import traceback
from contextlib import contextmanager

from actors.errors import TracefleetError


_IMPORT_RETRY_S = 0.2  # the alarm waits this long again while an import runs
_IMPORT_GRACE_S = 30.0  # ... up to this long after the bound


class TimeLimitError(TracefleetError):
    """Code in this process did not finish within its configured bound."""


class _Expired(BaseException):
    """The alarm's exception: a BaseException, past the user's ``except Exception``."""


def _importing(frame) -> bool:
    """Whether ``frame`` runs inside an import (importlib's frames are on its stack)."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def _where(exc: BaseException) -> str:
    """``file:line in function`` of the innermost frame of ``exc``'s traceback that is not the
    alarm's handler (the code the alarm stopped)."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename != __file__]
    if not frames:
        return "?"
    frame = frames[-1]
    return f"{frame.filename}:{frame.lineno} in {frame.name}"


@contextmanager
def time_limit(seconds: float, key: str, what: str = "the capture"):
    """Raise `TimeLimitError` when the block runs longer than ``seconds`` (``key`` names the
    setting, e.g. ``capture_timeout_s``); ``seconds <= 0`` or off the main thread: no bound."""
    if seconds <= 0 or threading.current_thread() is not threading.main_thread():
        yield
        return

    running, fired = [True], []

    def expire(signum, frame):
        if not running[0]:  # the block is done (the timer is being disarmed)
            return
        fired.append(time.monotonic())
        if _importing(frame) and fired[-1] - fired[0] < _IMPORT_GRACE_S:
            # a module half-imported would stay broken: a moment later (an import that never
            # ends, a hang in a module's top level, is stopped after the grace)
            signal.setitimer(signal.ITIMER_REAL, _IMPORT_RETRY_S)
            return
        raise _Expired()

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
        running[0] = False
    except _Expired as exc:
        raise TimeLimitError(f"{key}={seconds:g}: {what} did not finish within {seconds:g} s "
                             f"(stopped at {_where(exc)}); raise {key} if it needs "
                             "longer, or fix the step that does not return") from None
    finally:
        running[0] = False
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)

