"""Where a mesh job's roles are recorded: one after another in this process, several at once
in local worker processes, or as Ray tasks spread over a cluster's nodes.

A job on an N-D mesh records one rank per role (actors/capture/mesh_world.py): the eight
stages of a pipeline, the chunks of context parallelism. The recordings are independent, so
they can run side by side; what bounds that is memory (one 405B stage holds ~13 GiB while it
is recorded). Each recording runs in a process of its own under the capture's time bound and
``roles.memory_limit_gib``; a worker the kernel killed is named by its role. With
``num_workers=0`` the first role is recorded alone and its measured peak sizes the rest: as
many at once as this machine's CPUs and available memory hold. On Ray each task reserves
one CPU (and the memory bound), the tasks are spread over the nodes by a placement group,
and each task's trace files come back to the driver through the object store.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psutil

from actors.capture.mesh_world import RoleTask, RunRoles, record_role
from actors.errors import TracefleetError
from orchestrator.cluster.worker_pool import WorkerDied, in_fresh_processes
from orchestrator.config import ClusterConfig
from orchestrator.config import Executor
from orchestrator.run.roles_config import RolesConfig

log = logging.getLogger("tracefleet")
GIB = 2**30
MEMORY_SHARE = 0.8  # of the available memory the auto-sized roles may hold together


def role_runner(cfg: RolesConfig, key: str = "roles") -> RunRoles | None:
    """What records the roles (mesh_world.RunRoles); None: one after another in this
    process. ``cfg`` is validated by the config that holds it."""
    if cfg.executor == Executor.ray:
        return lambda tasks, bound: _on_ray(tasks, bound, cfg)
    if cfg.num_workers == 1:
        return None
    return lambda tasks, bound: _locally(tasks, bound, cfg.num_workers, key)


def _done(task: RoleTask, result: dict, index: int, num_tasks: int, where: str = "") -> dict:
    fact = result["facts"][0]
    log.info("capture: role %s (rank %d) recorded in %.1f s, peak %.2f GiB resident%s "
             "[%d/%d]", task.role, task.ranks[0], fact["record_s"],
             fact["record_peak_rss_bytes"] / GIB, where, index + 1, num_tasks)
    return result


def _locally(tasks: list[RoleTask], bound, num_workers: int, key: str) -> Iterator[dict]:
    """The roles in spawned processes, one process per role, ``num_workers`` at a time (0:
    sized by the first role's peak)."""
    done = 0
    if num_workers == 0:
        first = next(_in_processes(tasks[:1], bound, 1, key))
        yield _done(tasks[0], first, 0, len(tasks))
        done, rest = 1, tasks[1:]
        num_workers = _workers_for(first["facts"][0]["record_peak_rss_bytes"], len(rest))
        log.info("capture: %d role(s) left, %d at once (role %s peaked at %.2f GiB; %.1f GiB "
                 "available)", len(rest), num_workers, tasks[0].role,
                 first["facts"][0]["record_peak_rss_bytes"] / GIB,
                 psutil.virtual_memory().available / GIB)
    for offset, result in enumerate(_in_processes(tasks[done:], bound, num_workers, key)):
        yield _done(tasks[done + offset], result, done + offset, len(tasks))


def _workers_for(peak_bytes: int, num_left: int) -> int:
    """How many roles of ``peak_bytes`` this machine records at once."""
    by_memory = int(psutil.virtual_memory().available * MEMORY_SHARE // max(peak_bytes, 1))
    return max(1, min(os.cpu_count() or 1, num_left, by_memory))


def _in_processes(tasks: list[RoleTask], bound, num_workers: int, key: str) -> Iterator[dict]:
    results = in_fresh_processes(record_role, [(task, bound) for task in tasks], num_workers)
    for task in tasks:
        try:
            yield next(results)
        except WorkerDied as exc:
            raise TracefleetError(
                f"the process recording role {task.role} (rank {task.ranks[0]}) ended without "
                f"a result (exit code {exc.exitcode}: killed by the kernel, out of memory?); "
                f"set {key}.memory_limit_gib to stop a role that grows too large by name, or "
                f"record fewer at once ({key}.num_workers)") from None


def _record_on_node(task: RoleTask, bound) -> dict:
    """In a Ray task: record ``task`` into a folder on this node; the files' bytes come
    back."""
    with tempfile.TemporaryDirectory(prefix="tracefleet-role-") as tmp:
        result = record_role(dataclasses.replace(task, out_dir=tmp), bound)
        files = {}
        for fact in result["facts"]:
            name = os.path.basename(fact["path"])
            files[name] = Path(fact["path"]).read_bytes()
            fact["path"] = os.path.join(task.out_dir, name)
    return {**result, "files": files}


def _on_ray(tasks: list[RoleTask], bound, cfg: RolesConfig) -> Iterator[dict]:
    """The roles as Ray tasks, ``num_workers`` at a time, spread over the nodes
    (orchestrator/cluster/ray_pool.py); each role's files written here as it comes back."""
    from orchestrator.cluster.ray_pool import in_ray_tasks  # ray: only for roles on Ray

    results = in_ray_tasks(
        _record_on_node, [(task, bound) for task in tasks], max(cfg.num_workers, 1),
        ClusterConfig(address=cfg.ray_address), bound.timeout_s or math.inf,
        lambda i: f"role {tasks[i].role} (rank {tasks[i].ranks[0]})",
        memory_bytes=int(cfg.memory_limit_gib * GIB))
    for index, (task, (result, node_id)) in enumerate(zip(tasks, results)):
        for name, data in result.pop("files").items():
            Path(task.out_dir, name).write_bytes(data)
        for fact in result["facts"]:
            fact["node_id"] = node_id
        yield _done(task, result, index, len(tasks), f" on node {node_id[:8]}")
