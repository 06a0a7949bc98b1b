"""Independent tasks as Ray tasks spread over a cluster's nodes: worker_pool.py's interface
(results in submission order, the tasks' ``tell_parent`` messages as they are sent), on the
cluster the product already runs on (a fit search's axes, a mesh job's roles).

A placement group of ``num_workers`` one-CPU bundles, ``SPREAD`` over the nodes, holds the
tasks (task ``i`` in bundle ``i % num_workers``: each bundle runs its tasks one after
another); each task runs in a process of its own (``max_calls=1``: its memory is its own). The
messages travel through a Ray queue. Every wait is bounded: the placement by
``cluster.timeout_s``, the results by ``task_timeout_s`` per task a bundle runs, plus that.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import ray
from ray.exceptions import RayError, RayTaskError
from ray.util.placement_group import remove_placement_group
from ray.util.queue import Queue
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.errors import TracefleetError
from orchestrator.cluster import worker_pool
from orchestrator.cluster.connect import connect
from orchestrator.cluster.placement import reserve_bundles
from orchestrator.cluster.rank_result import failure_text
from orchestrator.config import ClusterConfig

POLL_S = 0.2  # how often the driver looks for messages while it waits for a result


def _run(fn: Callable, args: tuple, queue):
    """On the node: ``(fn(*args), this node's id)``, ``tell_parent`` sending into ``queue``."""
    worker_pool._attach(queue)
    return fn(*args), ray.get_runtime_context().get_node_id()


def in_ray_tasks(fn: Callable, tasks: list[tuple], num_workers: int, cluster: ClusterConfig,
                 task_timeout_s: float, what: Callable[[int], str],
                 on_message: Callable = lambda message: None,
                 memory_bytes: int = 0) -> Iterator[tuple[object, str]]:
    """``(fn(*task), node id)`` of every task, as Ray tasks on ``cluster`` (joined, or a local
    one started and stopped here), yielded in the tasks' order as each is ready. ``what(i)``
    names task ``i`` in errors; ``memory_bytes`` is reserved by each bundle (0: none). A
    task's TracefleetError is raised as it is; any other failure names the task."""
    num_bundles = max(1, min(num_workers, len(tasks)))
    handle = connect(cluster, num_bundles)
    pg = None
    try:
        memory = {"memory": memory_bytes} if memory_bytes else {}
        pg = reserve_bundles({"CPU": 1, **memory}, num_bundles, "SPREAD", cluster.timeout_s)
        queue = Queue()
        remote = ray.remote(max_calls=1)(_run)
        refs = [remote.options(num_cpus=1, **memory, max_retries=0,
                               scheduling_strategy=PlacementGroupSchedulingStrategy(
                                   pg, placement_group_bundle_index=i % num_bundles)
                               ).remote(fn, task, queue) for i, task in enumerate(tasks)]
        rounds = -(-len(tasks) // num_bundles)
        deadline = time.monotonic() + rounds * task_timeout_s + cluster.timeout_s

        def drain() -> None:
            while not queue.empty():
                on_message(queue.get_nowait())

        for i, ref in enumerate(refs):
            while not ray.wait([ref], timeout=POLL_S)[0]:
                drain()
                if time.monotonic() > deadline:
                    raise TracefleetError(
                        f"{what(i)} did not finish on Ray within {rounds} x {task_timeout_s:g} s "
                        f"+ cluster.timeout_s={cluster.timeout_s:g} s")
            drain()
            try:
                yield ray.get(ref)
            except RayTaskError as exc:
                if isinstance(exc.cause, TracefleetError):
                    raise exc.cause from None
                raise TracefleetError(f"{what(i)} failed on Ray: {failure_text(exc)}") from None
            except RayError as exc:  # the task's process died (killed, out of memory, ...)
                raise TracefleetError(f"the Ray task of {what(i)} died: "
                                      f"{failure_text(exc)}") from None
    finally:
        if pg is not None:
            remove_placement_group(pg)
        handle.shutdown()
