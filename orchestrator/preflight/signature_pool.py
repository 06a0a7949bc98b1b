"""Compute every selected rank's signature where it is cheapest, never holding full traces here.

* ``inline``: one trace at a time in this process (small folders: a worker costs more than
  the load); each trace is dropped as soon as it is reduced.
* ``processes``: a spawned process pool on this machine (no Ray cluster up).
* ``ray``: one Ray task per rank on the cluster, in parallel (a cluster is up); the nodes read
  the traces from the shared filesystem, so only signatures travel to the driver.

Every wait is bounded by ``timeout_s``.
"""
from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor, wait

from actors.errors import TraceError, TracefleetError
from actors.trace.source import TraceSource, json_bytes_estimate
from orchestrator.preflight.signature import RankSignature, rank_signature

EXECUTORS = ("inline", "processes", "ray")
IN_PROCESS_BYTES = 8 << 20  # total JSON bytes reduced in-process without workers
_MAX_PROCESSES = 8


def pick_executor(sources: dict[int, TraceSource]) -> str:
    """inline for small folders, else Ray tasks if Ray is up with a CPU free, else a process
    pool (also for one large trace: loading 180 MB of JSON takes ~2 GB, which the driver must
    not hold). A kept actor group of a sweep may hold every CPU of the cluster: tasks would
    then wait for a CPU that never comes free, so the pool on this machine takes them."""
    if json_bytes_estimate(sources.values()) < IN_PROCESS_BYTES:
        return "inline"
    import ray
    if ray.is_initialized() and ray.available_resources().get("CPU", 0) >= 1:
        return "ray"
    return "processes"


def collect(sources: dict[int, TraceSource], group_map: dict | None, executor: str | None = None,
            num_workers: int | None = None, timeout_s: float = 3600.0) -> dict[int, RankSignature]:
    """``{rank: RankSignature}`` for ``sources`` (``executor`` None: `pick_executor`)."""
    executor = executor or pick_executor(sources)
    if executor == "inline":
        return {rank: rank_signature(src, rank, group_map) for rank, src in sources.items()}
    if executor == "processes":
        return _in_processes(sources, group_map, num_workers, timeout_s)
    if executor == "ray":
        return _in_ray_tasks(sources, group_map, timeout_s)
    raise ValueError(f"executor {executor!r}; expected one of {EXECUTORS}")


def _late(sources, late_ranks, timeout_s) -> TraceError:
    names = [str(sources[r]) for r in late_ranks]
    shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
    return TraceError(names[0], f"reducing {len(names)} trace(s) ({shown}) took longer than "
                                f"{timeout_s:g} s")


def _in_processes(sources, group_map, num_workers, timeout_s) -> dict[int, RankSignature]:
    num_workers = num_workers or min(len(sources), os.cpu_count() or 1, _MAX_PROCESSES)
    # spawn, not fork: the driver may already hold Ray's threads
    pool = ProcessPoolExecutor(num_workers, mp_context=multiprocessing.get_context("spawn"))
    late = set()
    try:
        futures = {rank: pool.submit(rank_signature, src, rank, group_map)
                   for rank, src in sources.items()}
        _, late = wait(futures.values(), timeout=timeout_s)
        if late:
            raise _late(sources, [r for r, f in futures.items() if f in late], timeout_s)
        return {rank: fut.result() for rank, fut in futures.items()}  # re-raises a TraceError
    finally:
        _stop(pool, still_running=bool(late))


def _stop(pool: ProcessPoolExecutor, still_running: bool) -> None:
    """Stop the pool and wait for its workers to exit (at once: every task is done, or its
    worker killed). Left to exit during interpreter shutdown, the pool's manager thread raced a
    refusal's quick exit and printed "OSError: [Errno 9] Bad file descriptor" after its line."""
    if still_running:  # Python 3.11's pool cannot terminate its workers itself
        for proc in list((getattr(pool, "_processes", None) or {}).values()):
            proc.kill()
    pool.shutdown(wait=True, cancel_futures=True)


def _in_ray_tasks(sources, group_map, timeout_s) -> dict[int, RankSignature]:
    import ray

    task = ray.remote(num_cpus=1, max_retries=0)(rank_signature)
    refs = {rank: task.remote(src, rank, group_map) for rank, src in sources.items()}
    _, late = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
    if late:
        for ref in late:
            ray.cancel(ref, force=True)
        late_set = set(late)
        raise _late(sources, [r for r, ref in refs.items() if ref in late_set], timeout_s)
    out = {}
    for rank, ref in refs.items():
        try:
            out[rank] = ray.get(ref)
        except ray.exceptions.RayTaskError as e:
            if isinstance(e.cause, TracefleetError):
                raise e.cause from None
            raise TraceError(sources[rank], f"cannot reduce trace: {e.cause!r}") from None
    return out
