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

With ``stall_s`` the block is also stopped when it waits without end: the timer samples
where the code is (every frame's function and line) ``STALL_SAMPLES`` times per ``stall_s``,
and a block found at the very same place in every sample for ``stall_s`` while its thread
used almost no CPU (a step waiting on a lock, a queue, a socket or a sleep that never ends)
is stopped then, well before the total bound. Code that computes (a busy loop, one long C
call) or moves, however slowly, is not a stall: it runs to the total bound.
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
STALL_SAMPLES = 6  # samples of where the code is per stall_s
_MAX_FRAMES = 64  # frames of a place compared (the innermost: where a wait is)
_BUSY = 0.1  # a thread that used more CPU than this share of the time computes, not waits


class TimeLimitError(TracefleetError):
    """Code in this process did not finish within its configured bound."""


class _Expired(BaseException):
    """The alarm's exception: a BaseException, past the user's ``except Exception``."""


class _Stalled(BaseException):
    """The alarm found the block at the same place for ``stall_s`` (args: where)."""


def _importing(frame) -> bool:
    """Whether ``frame`` runs inside an import (importlib's frames are on its stack)."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def stopped_at(exc: BaseException, handler_file: str = __file__) -> str:
    """``file:line in function`` of the innermost frame of ``exc``'s traceback outside
    ``handler_file`` (the signal handler's module: the code the handler stopped)."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename != handler_file]
    if not frames:
        return "?"
    frame = frames[-1]
    return f"{frame.filename}:{frame.lineno} in {frame.name}"


def stop_behind(exc: BaseException, kind: type) -> BaseException | None:
    """``exc``, or an exception it was raised while handling (``__context__``, followed), that
    is a ``kind`` (a bound's own stop); None if none is. A stop raised in arbitrary code can
    land inside a library's cleanup and make it fail on the way out (torch's mode stack half
    popped: "trying to set the current FakeTensorMode, but one already exists"): the block
    then sees that failure, whose cause is the stop."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, kind):
            return exc
        seen.add(id(exc))
        exc = exc.__context__
    return None


def _place(frame) -> tuple:
    """Where the code is: every frame's code and line, innermost first."""
    place = []
    while frame is not None and len(place) < _MAX_FRAMES:
        place.append((frame.f_code, frame.f_lineno))
        frame = frame.f_back
    return tuple(place)


def _frame_text(frame) -> str:
    return f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"


@contextmanager
def time_limit(seconds: float, key: str, what: str = "the capture", stall_s: float = 0.0,
               stall_key: str = "capture_stall_s"):
    """Raise `TimeLimitError` when the block runs longer than ``seconds`` (``key`` names the
    setting, e.g. ``capture_timeout_s``), or, with ``stall_s`` > 0, stays at one place that
    long (``stall_key`` names that setting; see the module docstring); ``seconds <= 0`` or
    off the main thread: no bound."""
    if seconds <= 0 or threading.current_thread() is not threading.main_thread():
        yield
        return

    start = time.monotonic()
    deadline = start + seconds
    tick = min(seconds, stall_s / STALL_SAMPLES) if stall_s > 0 else seconds
    running, fired = [True], []
    still = {"place": None, "since": start, "cpu_s": time.thread_time()}

    def arm(now: float) -> None:
        signal.setitimer(signal.ITIMER_REAL, max(min(tick, deadline - now), 1e-3))

    def expire(signum, frame):
        if not running[0]:  # the block is done (the timer is being disarmed)
            return
        now = time.monotonic()
        if now < deadline:
            place, cpu_s = _place(frame), time.thread_time()
            waited_s = now - still["since"]
            if place != still["place"] or cpu_s - still["cpu_s"] > _BUSY * waited_s:
                still.update(place=place, since=now, cpu_s=cpu_s)
            elif waited_s >= stall_s and not _importing(frame):
                raise _Stalled(_frame_text(frame))
            arm(now)
            return
        fired.append(now)
        if _importing(frame) and fired[-1] - fired[0] < _IMPORT_GRACE_S:
            # a module half-imported would stay broken: a moment later (an import that never
            # ends, a hang in a module's top level, is stopped after the grace)
            signal.setitimer(signal.ITIMER_REAL, _IMPORT_RETRY_S)
            return
        raise _Expired()

    previous = signal.signal(signal.SIGALRM, expire)
    arm(start)
    try:
        yield
        running[0] = False
    except BaseException as exc:
        stalled, expired = stop_behind(exc, _Stalled), stop_behind(exc, _Expired)
        if stalled is not None:
            raise TimeLimitError(f"{stall_key}={stall_s:g}: {what} made no progress for "
                                 f"{stall_s:g} s: it stayed at {stalled.args[0]} (a wait or a "
                                 f"loop that never ends?); raise {stall_key} if it may stay "
                                 "there longer, or 0 to wait for the whole bound") from None
        if expired is not None:
            raise TimeLimitError(f"{key}={seconds:g}: {what} did not finish within {seconds:g} "
                                 f"s (stopped at {stopped_at(expired)}); raise {key} if it "
                                 "needs longer, or fix the step that does not return") from None
        raise
    finally:
        running[0] = False
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
