"""A bound on the resident memory of code that runs in this process (one role of a mesh
job recorded on fake, which may hold tens of GiB), and the peak it reached.

``memory_limit(limit_bytes, key, what)`` arms a CPU-time interval timer (``ITIMER_PROF``:
memory only grows while the process computes, so a waiting process is not woken) in the main
thread; each tick reads the process's resident set size and, past the bound, raises a
``BaseException`` in whatever Python code runs, so the user's ``except Exception`` cannot
swallow it and every ``finally`` runs. The block then raises `MemoryLimitError` naming the
key, the bound, the size reached and where the code was stopped. Code inside one long C call
(a JSON parse of a whole trace) is stopped when it returns. Off the main thread (signals
cannot be handled there) the block runs unbounded.

``PeakRss`` measures a block's peak resident set: the kernel's high-water mark (``VmHWM``),
reset at the block's start where Linux allows it (``/proc/self/clear_refs``), else the
process's peak so far (then named ``vmhwm_process``).
"""
from __future__ import annotations

import os
import signal
import threading
from contextlib import contextmanager

import psutil

from actors.errors import TracefleetError
from actors.time_limit import stop_behind, stopped_at

TICK_S = 0.05  # CPU seconds between two readings of the resident set
GIB = 2**30


class MemoryLimitError(TracefleetError):
    """Code in this process held more resident memory than its configured bound."""


class _OverMemory(BaseException):
    """The timer's exception (args: the resident bytes read)."""


@contextmanager
def memory_limit(limit_bytes: int, key: str, what: str):
    """Raise `MemoryLimitError` when this process's resident memory passes ``limit_bytes``
    inside the block (``key`` names the setting); ``limit_bytes <= 0`` or off the main
    thread: no bound."""
    if limit_bytes <= 0 or threading.current_thread() is not threading.main_thread():
        yield
        return
    process, running = psutil.Process(), [True]

    def check(signum, frame):
        if running[0]:
            rss = process.memory_info().rss
            if rss > limit_bytes:
                running[0] = False
                raise _OverMemory(rss)

    previous = signal.signal(signal.SIGPROF, check)
    signal.setitimer(signal.ITIMER_PROF, TICK_S, TICK_S)
    try:
        yield
    except BaseException as exc:
        over = stop_behind(exc, _OverMemory)
        if over is None:
            raise
        raise MemoryLimitError(
            f"{key}={limit_bytes / GIB:g} GiB: {what} held {over.args[0] / GIB:.2f} GiB "
            f"resident (stopped at {stopped_at(over, __file__)}); raise {key}, record fewer roles "
            "at once, or give the job a machine with more memory") from None
    finally:
        running[0] = False
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.signal(signal.SIGPROF, previous)


class PeakRss:
    """The peak resident set size of this process over a ``with`` block, in ``.bytes``;
    ``.method`` says how it was read: ``vmhwm`` (the kernel's mark, reset at the block's
    start) or ``vmhwm_process`` (the mark could not be reset: the process's peak so far)."""

    def __init__(self):
        self.bytes, self.method = 0, "vmhwm"

    def __enter__(self) -> "PeakRss":
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
        except OSError:
            self.method = "vmhwm_process"
        return self

    def __exit__(self, *exc_info) -> None:
        self.bytes = vm_hwm_bytes(os.getpid()) or psutil.Process().memory_info().rss


def vm_hwm_bytes(pid: int) -> int | None:
    """The peak resident memory (``VmHWM``) of process ``pid`` so far; None where Linux's
    /proc does not say it, or once the process is gone."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
