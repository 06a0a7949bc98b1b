"""What consecutive replays share: one Ray connection, one group of rank actors, pre-flight.

A sweep (``tracefleet --multirun``) or a minimum-memory search runs many replays of the same
traces one after another. Starting Ray (3-4 s here) and the rank actors (another 3-4 s) for
each would dominate; a ``ReplaySession`` keeps them, and the pre-flight result of each trace
folder, until ``close()``. The actors keep their loaded traces too (``RankActor`` caches them
by file version), so a later point skips the load as well.

Reuse is only safe from a known state: the actors are reused only when every rank returned a
report of a clean end (ok or oom) and then released their process groups; otherwise the
group is killed and the next replay starts a new one on the same cluster (on the nodes still
alive when a node was lost: orchestrator/cluster/placement.py bounds that wait).

With ``processes_record`` the processes of an embedded cluster started here are written to
that file while it runs, so a later run can stop them if this driver is killed
(orchestrator/cluster/stale_cluster.py).
"""
from __future__ import annotations

import logging
import os
from dataclasses import asdict, fields, replace
from pathlib import Path

import orjson
import ray

from actors.trace.source import as_source
from orchestrator.cluster import stale_cluster
from orchestrator.config import ClusterConfig
from orchestrator.cluster.connect import ClusterHandle, connect, cuda_available_in_cluster
from orchestrator.preflight.validate import PreflightResult, preflight
from orchestrator.cluster.worker_group import WorkerGroup
from orchestrator.status import ANSWERED  # a rank that ended so is kept for the next replay

log = logging.getLogger("tracefleet")

_RELEASE_S = 10.0  # bound on the actors' release of their process groups
_GRACEFUL_S = 5.0  # bound on the actors' own shutdown() before they are killed


def _files_key(paths) -> tuple:
    """The version of a set of files: path, size and mtime of each (an edit means reload)."""
    key = []
    for path in sorted(str(p) for p in paths):
        st = os.stat(path)
        key.append((path, st.st_size, st.st_mtime_ns))
    return tuple(key)


class ReplaySession:
    """Ray, rank actors and pre-flight results kept across replays; ``close()`` releases all."""

    def __init__(self, processes_record: Path | None = None):
        self._processes_record = processes_record
        self._cluster: ClusterHandle | None = None
        self._cluster_key: str | None = None
        self._group: WorkerGroup | None = None
        self._group_key: tuple | None = None
        self._preflight: dict[tuple, tuple[tuple, PreflightResult]] = {}
        self._blobs: dict[tuple, object] = {}  # (path, size, mtime) -> ObjectRef of its bytes

    def preflight(self, trace_dir: str, world_size: int | None,
                  group_map: dict | None, **options) -> PreflightResult:
        """``validate.preflight`` once per trace folder version (``options``: its keywords).

        A cached result keeps no traces (``traces=[]`` where the result has them): launching
        needs the files, the world and the groups only, and holding every rank's trace on the
        driver for a whole sweep is what a large world cannot afford.
        """
        key = (os.path.abspath(trace_dir), world_size,
               orjson.dumps(group_map, option=orjson.OPT_SORT_KEYS),
               orjson.dumps(options, option=orjson.OPT_SORT_KEYS, default=str))
        cached = self._preflight.get(key)
        if cached is not None:
            files_key, result = cached
            try:
                if _files_key(result.rank_files.values()) == files_key:
                    return result
            except OSError:  # a rank file went away: pre-flight again and say so
                pass
        result = preflight(trace_dir, world_size, group_map=group_map, **options)
        if "traces" in {f.name for f in fields(result)}:
            result = replace(result, traces=[])
        self._preflight[key] = (_files_key(result.rank_files.values()), result)
        return result

    def trace_blob(self, source):
        """The object-store reference of a rank trace's stored bytes (a file, or a member of
        an archive: `TraceSource.read_raw`), put once per file version."""
        source = as_source(source)
        key = _files_key([source.path]) + (source.member,)
        ref = self._blobs.get(key)
        if ref is None:
            ref = self._blobs[key] = ray.put(source.read_raw())
        return ref

    def connect(self, cfg: ClusterConfig, world_size: int) -> ClusterHandle:
        """The session's Ray connection, started (or joined) on first use and kept while
        ``cfg`` stays the same."""
        key = orjson.dumps(asdict(cfg), option=orjson.OPT_SORT_KEYS, default=str).decode()
        if self._cluster is not None and key != self._cluster_key:
            self._drop_group()
            self._cluster.shutdown()
            self._cluster = None
            self._blobs.clear()
        if self._cluster is None:
            self._cluster = connect(cfg, world_size)
            self._cluster_key = key
            self._record_processes()
        return self._cluster

    def use_gpu(self, device: str) -> bool:
        """Whether ranks get a GPU bundle: ``cuda``, or ``auto`` on a cluster with GPUs."""
        return device == "cuda" or (device == "auto" and cuda_available_in_cluster())

    def worker_group(self, actor_cls, world_size: int, cfg: ClusterConfig,
                     use_gpu: bool) -> WorkerGroup:
        """A started group of ``world_size`` ``actor_cls`` actors: the kept one when it fits,
        with a fresh rendezvous port, else a new one."""
        key = (actor_cls, world_size, use_gpu, cfg.cpus_per_rank, str(cfg.placement_strategy))
        if self._group is not None and key == self._group_key:
            try:
                self._group.rewire()
                return self._group
            except Exception as exc:  # noqa: BLE001 (any failure: start over, say why)
                log.warning("kept rank actors unusable (%s); starting new ones", exc)
                self._drop_group()
        self._drop_group()
        group = WorkerGroup(ray.remote(actor_cls), world_size, cfg, use_gpu=use_gpu).start()
        self._group, self._group_key = group, key
        self._record_processes()  # the raylet's agents surely run once actors could start
        return group

    def release(self, group: WorkerGroup, results: list | None, timeout_s: float) -> None:
        """After a replay: keep the actors, their process groups destroyed, when every rank
        returned a report of a clean end (``ok``, or ``oom``: the accounting or the allocator
        refused before the op ran); kill them after anything else (a failed collective can
        leave a rank's communicator in an unknown state). ``results``: the group's Results."""
        reusable = results is not None and all(
            r.ok and isinstance(r.value, dict) and r.value.get("status") in ANSWERED
            for r in results)
        # no results: the wait was cut short (a signal, an error), the actors may be mid-call
        # and would answer a polite shutdown only after it: killed at once
        graceful_s = 0.0 if results is None else _GRACEFUL_S
        if group is not self._group:
            group.shutdown(graceful_timeout_s=graceful_s)
            return
        if reusable and group.release(min(timeout_s, _RELEASE_S)):
            return
        self._drop_group(graceful_s)

    def close(self) -> None:
        """Kill the actors and stop (or leave) the Ray cluster this session started."""
        self._drop_group()
        if self._cluster is not None:
            self._cluster.shutdown()
            self._cluster = None
        if self._processes_record is not None:
            stale_cluster.forget(self._processes_record)
        self._blobs.clear()
        self._preflight.clear()

    def _record_processes(self) -> None:
        """Write the embedded cluster's processes to the record (see the module docstring)."""
        if self._processes_record is not None and self._cluster is not None \
                and self._cluster.started_ray:
            stale_cluster.record(self._processes_record, stale_cluster.cluster_processes())

    def _drop_group(self, graceful_s: float = _GRACEFUL_S) -> None:
        if self._group is not None:
            self._group.shutdown(graceful_timeout_s=graceful_s)
        self._group, self._group_key = None, None
