"""Capture an N-D mesh job on the fake device: one recorded rank per role, every other
rank's trace derived from its role's.

A 1-D job records rank 0 and writes its trace for every rank (actors/capture/meta_world.py).
On a mesh the ranks differ: pipeline stages hold other layers, context-parallel ranks attend
other chunks (actors/capture/workloads/mesh.py's ``rank_roles``), and every rank runs its
collectives on its own process groups. So each role's first rank is recorded in a fake world of its
own (fake process group, the job's mesh built before the fake mode, the c10d ops' groups named:
actors/capture/fake/group_names.py); each other rank's file is its role's trace with the group
names of that rank (whose process-group table comes from building the same mesh as that
rank, nothing else). Ranks of one role thus differ in group names only, and a dry run
(tracefleet-predict) replays one file per role. As on a 1-D fake capture, the recorded step
writes the run's own frees (actors/capture/fake/free_markers.py): storages torch's parallel code
keeps referenced past their last use (ring attention's gathered keys and values, held by its
rotater until the ring returns) are held as long by the faithful replay.
"""
from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass
from typing import ContextManager

import torch
import torch.distributed as dist

from actors.capture.fake.fake_mode import strip_dispatch_mode_nodes
from actors.capture.fake.group_names import GroupNamingFakeMode, name_c10d_groups
from actors.capture.environment_reads import environment_reads, note_reads
from actors.capture.memory import MemoryMeter
from actors.capture.fake_rank import FAKE_MEMORY_METHOD, fake_errors, fake_tensors, record_workload
from actors.capture.workloads.mesh import build_mesh, rank_roles
from actors.capture.fake.meta_storage import unique_meta_storages
from actors.capture.workloads.parallelize.eager_dtensor import eager_dtensor
from actors.capture.fake.subclass_frames import mark_subclass_frames
from actors.capture.trace_file import write_as_ranks
from actors.capture.request import CaptureRequest
from actors.capture.worker import rank_facts
from actors.capture.workloads.build import build_workload
from actors.errors import ConfigError, TracefleetError
from actors.gc_pause import gc_paused
from actors.memory_limit import PeakRss
from actors.trace.conventions import trace_file_name

# records a job's roles: (tasks, bound) -> each task's record_role result, in the tasks' order
RunRoles = Callable[[list["RoleTask"], Callable[[str], ContextManager]], Iterator[dict]]


def _fake_group(rank: int, world_size: int) -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers "fake"

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


def mesh_group_table(par, world_size: int, rank: int) -> list[dict]:
    """The process-group table rank ``rank`` of the job's mesh records (fake world, no
    model)."""
    from torch.distributed.distributed_c10d import _world

    _fake_group(rank, world_size)
    try:
        build_mesh("cpu", par, world_size)
        return [dict(g) for g in _world.pg_config_info]
    finally:
        dist.destroy_process_group()


def record_mesh_rank(request: CaptureRequest, out_dir: str, rank: int, world_size: int):
    """Record rank ``rank`` of ``request``'s fake mesh job into out_dir; ``(workload, trace
    path)``."""
    wl_cfg = request.workload
    if wl_cfg.device != "fake":
        raise ConfigError(f"workload.parallelism ({wl_cfg.parallelism.describe(world_size)}) "
                          f"on workload.device={wl_cfg.device}: a mesh job is captured on "
                          "fake (or for real on cpu/cuda), not on meta")
    path = os.path.join(out_dir, trace_file_name(rank))
    with unique_meta_storages():
        _fake_group(rank, world_size)
        try:
            mesh = build_mesh("cpu", wl_cfg.parallelism, world_size)  # before the mode
            mode = GroupNamingFakeMode()
            with fake_errors("fake"), eager_dtensor(), fake_tensors(mode):
                workload = build_workload(wl_cfg, rank, world_size, torch.device("cpu"), mesh)

                def step(batch):
                    mode.group_log.clear()  # only the recorded iteration's calls
                    workload.step(batch)

                def rewrite(doc):
                    mark_subclass_frames(doc)
                    strip_dispatch_mode_nodes(doc)
                    name_c10d_groups(doc, mode.group_log, f"rank {rank}'s capture")

                record_workload(workload, request, path, mode, step=step, rewrite=rewrite)
        finally:
            dist.destroy_process_group()
    return workload, path


@dataclass(frozen=True)
class RoleTask:
    """One role of a mesh job to record: its first rank recorded, its other ranks' files
    derived (all of them, or none with ``num_files``). Picklable: a worker process or a Ray
    task records it as this process would."""

    request: CaptureRequest
    out_dir: str
    role: str
    ranks: tuple[int, ...]
    world_size: int
    num_files: int | None
    mesh: dict  # the job's mesh, as every fact names it: degrees, description, roles


def mesh_role_tasks(request: CaptureRequest, out_dir: str, world_size: int,
                    num_files: int | None = None) -> list[RoleTask]:
    """The roles of ``request``'s mesh job, one task each, in the mesh's order."""
    wl = request.workload
    par = wl.parallelism
    roles = rank_roles(par, world_size,
                       skewed_experts=wl.moe_experts > 0 and wl.moe_routing_skew > 0)
    mesh = {"degrees": par.degrees(world_size), "description": par.describe(world_size),
            "roles": roles}
    return [RoleTask(request, out_dir, role, tuple(ranks), world_size, num_files, mesh)
            for role, ranks in roles.items()]


def record_role(task: RoleTask, bound: Callable[[str], ContextManager]) -> dict:
    """Record ``task``'s role in this process: ``{"facts": [one per written rank],
    "environment": the variables the step read}``; each fact carries the recording's
    seconds and its peak resident memory (actors/memory_limit.py's ``PeakRss``)."""
    os.makedirs(task.out_dir, exist_ok=True)
    par, first_rank = task.request.workload.parallelism, task.ranks[0]
    no_memory = MemoryMeter(torch.device("meta")).result()
    no_memory["method"] = FAKE_MEMORY_METHOD
    start = time.perf_counter()
    with environment_reads() as names, PeakRss() as peak:
        with bound(f"recording of rank {first_rank} (role {task.role})"), gc_paused():
            workload, first = record_mesh_rank(task.request, task.out_dir, first_rank,
                                               task.world_size)
    record_s = time.perf_counter() - start
    written = [first_rank] if task.num_files else list(task.ranks)
    paths = {rank: first if rank == first_rank else os.path.join(task.out_dir,
                                                                   trace_file_name(rank))
             for rank in written}

    def check_table(table: list[dict]) -> None:
        if table != mesh_group_table(par, task.world_size, first_rank):
            raise TracefleetError(f"rank {first_rank}'s trace lists other process groups "
                                  "than its mesh makes (the step made groups of its own?): "
                                  "its role's other ranks cannot be derived from it")

    write_as_ranks(first, check_table, {paths[r]: (mesh_group_table(par, task.world_size, r),
                                                   f"rank {r} from rank {first_rank}")
                                        for r in written if r != first_rank})
    facts = []
    for rank in written:
        path = paths[rank]
        facts.append({**rank_facts(rank, task.world_size, workload, path, None, [], no_memory),
                      "recorded_as_rank": first_rank, "record_s": record_s, "role": task.role,
                      "mesh": task.mesh, "record_peak_rss_bytes": peak.bytes,
                      "record_peak_rss_method": peak.method, "record_pid": os.getpid()})
    del workload
    gc.collect()  # the role's cycles, made while the GC was paused: before the next role's
    return {"facts": facts, "environment": sorted(names)}


def _in_order(tasks: list[RoleTask], bound: Callable[[str], ContextManager]) -> Iterator[dict]:
    return (record_role(task, bound) for task in tasks)


def run_mesh_capture(request: CaptureRequest, out_dir: str, world_size: int,
                     num_files: int | None = None,
                     bound: Callable[[str], ContextManager] = lambda _what: nullcontext(),
                     run_roles: RunRoles | None = None) -> list[dict]:
    """Capture the fake mesh job of ``request`` into out_dir: one recorded rank per role, the
    other ranks' files derived (see the module docstring); their facts in rank order.
    ``num_files`` set: write only the recorded ranks' files (one per role: what a dry run
    needs). Each role's recording runs in ``bound(what)`` (the caller's limits).
    ``run_roles(tasks, bound)`` records the roles (their ``record_role`` results, in the
    tasks' order): the driver's worker processes or Ray tasks; by default one after another
    in this process."""
    tasks = mesh_role_tasks(request, out_dir, world_size, num_files)
    facts = []
    for result in (run_roles or _in_order)(tasks, bound):
        note_reads(result["environment"])  # read in a worker: the capture's reads too
        facts += result["facts"]
    return sorted(facts, key=lambda f: f["rank"])
