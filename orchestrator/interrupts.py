"""SIGINT and SIGTERM stop a command the way Ctrl-C does: an exception, so every ``finally``
on the way out runs (actors killed, Ray shut down, half-written files removed), then one line
and exit ``128 + signal``.

``stop_on_signals()`` is entered by the console scripts (orchestrator/cli/app.py). Inside it
the first signal raises `Interrupted` (a ``KeyboardInterrupt``, so ``except Exception`` in
library code does not swallow it) in the main thread; a second one while the first is being
cleaned up ends the process at once, every process it started killed first (by pid, the
whole tree listed before any is killed). Ray's driver start-up installs its own SIGTERM handler
(Ray 2.60's aborts the process with a stack dump, rc -6): `reassert()` puts ours back, and
orchestrator/cluster/connect.py calls it after ``ray.init``.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
from contextlib import contextmanager

import psutil

SIGNALS = (signal.SIGINT, signal.SIGTERM)
_active = False  # inside stop_on_signals()
_stopping: int | None = None  # the signal being handled, once one arrived


class Interrupted(KeyboardInterrupt):
    """A signal (``signum``) asked the command to stop; it exits ``128 + signum``."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(signal.Signals(signum).name)


def signal_of(exc: KeyboardInterrupt) -> int:
    """The signal behind a KeyboardInterrupt: ours carries it; a plain one is the signal our
    handler saw (Ray's ``ray.wait`` re-raises any error of a signal handler as a plain
    KeyboardInterrupt), else Ctrl-C's SIGINT."""
    if isinstance(exc, Interrupted):
        return exc.signum
    return _stopping if _stopping is not None else int(signal.SIGINT)


def name_of(exc: KeyboardInterrupt) -> str:
    """``SIGINT`` or ``SIGTERM``: the signal behind a KeyboardInterrupt, by name."""
    return signal.Signals(signal_of(exc)).name


def _handle(signum, frame) -> None:
    global _stopping
    if _stopping is not None:  # the first one is being cleaned up: the user insists
        killed = kill_descendants()
        print(f"{os.path.basename(sys.argv[0])}: {signal.Signals(signum).name} again while "
              f"stopping: exiting now ({killed} process(es) it started killed)",
              file=sys.stderr, flush=True)
        os._exit(128 + signum)
    _stopping = signum
    raise Interrupted(signum)


def kill_descendants() -> int:
    """SIGKILL every process this one started, and theirs (Ray's GCS, raylet, dashboard and
    runtime-env agents, actors, pool workers), by pid; the number killed. The whole tree is
    listed before any is killed: a parent killed first would orphan its children out of it."""
    try:
        tree = psutil.Process().children(recursive=True)
    except psutil.Error:
        return 0
    killed = 0
    for proc in tree:
        try:
            proc.kill()
            killed += 1
        except psutil.Error:  # gone already
            pass
    return killed


def reassert() -> None:
    """Install the handlers again (after a library replaced them: Ray's driver start-up);
    a no-op outside ``stop_on_signals()`` or off the main thread."""
    if _active and threading.current_thread() is threading.main_thread():
        for signum in SIGNALS:
            signal.signal(signum, _handle)


@contextmanager
def stop_on_signals():
    """Within the block SIGINT and SIGTERM raise `Interrupted` (see the module docstring);
    the previous handlers are put back after it."""
    global _active, _stopping
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signum: signal.getsignal(signum) for signum in SIGNALS}
    _active, _stopping = True, None
    reassert()
    try:
        yield
    finally:
        _active = False
        for signum, handler in previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
