"""The embedded Ray cluster of a sweep whose driver was killed: recorded, and stopped on resume.

When the driver is SIGKILLed, Ray's GCS and raylet die with it (they share its fate), but
processes the raylet started can outlive it: on Ray 2.60 its dashboard and runtime-env agents
are re-parented to init and keep running. A sweep therefore writes the processes of the
cluster it started to a record file under its root while the cluster runs, deletes the record
when it stops the cluster itself, and a sweep that starts in the same root and finds a record
(its driver gone) stops the processes listed there.

A process is identified by its pid and its start time, so a pid reused since is never hit.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

import orjson
import psutil

from actors.atomic_file import atomic_write

log = logging.getLogger("tracefleet")

RECORD_NAME = ".ray_processes.json"
_KILL_WAIT_S = 5.0  # bound on waiting for the killed processes to be gone


def _identity(proc: psutil.Process) -> dict:
    return {"pid": proc.pid, "create_time": proc.create_time()}


def record(path: Path, processes: list[psutil.Process]) -> None:
    """Write ``processes`` (a cluster this driver started) and this driver to ``path``."""
    entries = []
    for proc in processes:
        try:
            entries.append(_identity(proc))
        except psutil.Error:  # already gone: nothing to stop later
            pass
    data = {"driver": _identity(psutil.Process()), "processes": entries}
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, orjson.dumps(data))


def forget(path: Path) -> None:
    """Delete the record: its cluster was stopped by the driver that started it."""
    path.unlink(missing_ok=True)


def _same(entry: dict) -> psutil.Process | None:
    """The process of ``entry`` if it still runs (same pid, same start time), else None."""
    try:
        proc = psutil.Process(int(entry["pid"]))
        if abs(proc.create_time() - float(entry["create_time"])) < 0.01:
            return proc
    except (psutil.Error, KeyError, TypeError, ValueError):
        pass
    return None


def reap(path: Path) -> list[int]:
    """Stop what a killed driver's cluster left running (see the module docstring); returns
    the pids killed. A record whose driver still runs is left alone (another sweep in the
    same root is using that cluster)."""
    if not path.is_file():
        return []
    try:
        data = orjson.loads(path.read_bytes())
    except orjson.JSONDecodeError:  # cannot name anything to stop
        log.warning("ignoring an unreadable record of a previous Ray cluster: %s", path)
        forget(path)
        return []
    if _same(data.get("driver") or {}) is not None:
        log.warning("the sweep that started the Ray cluster recorded in %s still runs "
                    "(pid %s): leaving its cluster alone", path, data["driver"].get("pid"))
        return []
    procs = [p for p in map(_same, data.get("processes") or []) if p is not None]
    for proc in procs:
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=_KILL_WAIT_S)
    forget(path)
    if procs:
        log.warning("stopped %d process(es) left running by the Ray cluster of a killed sweep "
                    "(pids %s)", len(procs), ", ".join(str(p.pid) for p in procs))
    return [p.pid for p in procs]


def stop_survivors(processes: list[psutil.Process], timeout_s: float) -> list[int]:
    """Wait up to ``timeout_s`` for ``processes`` (an embedded cluster just shut down) to
    exit, kill those still running (by pid, psutil checks it was not reused); their pids."""
    _, alive = psutil.wait_procs(processes, timeout=timeout_s)
    for proc in alive:
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=_KILL_WAIT_S)
    if alive:
        log.warning("killed %d process(es) of the Ray cluster still running %.0f s after it "
                    "was shut down (pids %s)", len(alive), timeout_s,
                    ", ".join(str(p.pid) for p in alive))
    return [p.pid for p in alive]


def cluster_processes() -> list[psutil.Process]:
    """This process's descendants: with an embedded cluster, its GCS, raylet, agents and
    workers (the driver starts them, and the raylet starts the rest)."""
    try:
        return psutil.Process(os.getpid()).children(recursive=True)
    except psutil.Error:
        return []
