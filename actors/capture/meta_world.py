"""Capture a ``workload.device=meta`` or ``fake`` world in this process: no Ray, no data, any
world size.

On meta and fake nothing is computed and nothing communicated. A rank joins torch's fake
process group (backend ``fake``: collectives complete at once and touch no data, but dispatch
as ``c10d::*`` ops the ET observer records with their real sizes), builds the model (on meta;
on fake on ``cpu`` inside :class:`actors.capture.fake.fake_mode.CaptureFakeMode`, with the 1-D
mesh made before the mode), warms up once (the optimizer state must exist before the recorded
iteration, as in a real run) and records one iteration. Neither meta nor fake tensors carry
values, so neither tensor ranges nor timings nor memory are recorded.

Every rank of a data-parallel or local workload runs the same program on the same shapes,
and on meta no value differs either, so rank 0 is recorded once and its trace is written for
every rank (the observer costs ~7 s per rank on a 70B-class model) as a hard link of rank 0's
file where the filesystem allows it (a copy otherwise): 1,024 ranks cost no disk, and
pre-flight groups the copies by inode before hashing (orchestrator/preflight/trace_identity.py).
tests/test_capture.py checks on a small world that a separately recorded rank gives the same trace.
On fake the same holds for FSDP2 where every sharded dimension divides by the world size;
otherwise the last ranks' real shards are smaller than rank 0's (FSDP2 pads them to rank
0's size for its collectives, which are therefore the same).
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable
from contextlib import nullcontext
from typing import ContextManager

from actors.capture.environment_reads import environment_of, environment_reads
from actors.capture.fake_rank import FAKE_MEMORY_METHOD, META, record_meta_rank
from actors.capture.memory import MemoryMeter
from actors.capture.mesh_world import RunRoles, run_mesh_capture
from actors.capture.request import CaptureRequest
from actors.capture.worker import rank_facts
from actors.gc_pause import gc_paused
from actors.hardlink import link_or_copy
from actors.trace.conventions import trace_file_name


def run_meta_capture(request: CaptureRequest, out_dir: str, world_size: int,
                     num_files: int | None = None,
                     bound: Callable[[str], ContextManager] | None = None,
                     run_roles: RunRoles | None = None) -> list[dict]:
    """Capture ranks 0..world_size-1 of ``request``'s meta or fake workload into out_dir;
    their facts in rank order. ``num_files``
    writes only the first ranks' files (the rest would be copies of rank 0's). A job on an
    N-D mesh records one rank per role instead (actors/capture/mesh_world.py). ``bound(what)``
    makes the context each recorded rank runs in (the caller's time limit: per recording, so
    a 3-D job's eight pipeline stages get eight times a 1-D job's bound). ``run_roles``
    records a mesh job's roles (mesh_world.RunRoles; by default one after another here)."""
    with environment_reads() as names:
        facts = _capture_world(request, out_dir, world_size, num_files,
                               bound or (lambda _what: nullcontext()), run_roles)
    environment = environment_of(names)  # what the user's code read: the capture cache's too
    return [{**f, "environment": environment} for f in facts]


def _capture_world(request: CaptureRequest, out_dir: str, world_size: int,
                   num_files: int | None, bound: Callable[[str], ContextManager],
                   run_roles: RunRoles | None) -> list[dict]:
    wl = request.workload
    if not wl.parallelism.is_one_dim() or wl.float8:  # tensor subclasses: see mesh_world
        return run_mesh_capture(request, out_dir, world_size, num_files, bound, run_roles)
    os.makedirs(out_dir, exist_ok=True)
    start = time.perf_counter()
    # The fake mode and autograd make millions of short-lived objects, few in cycles: left on,
    # the cyclic GC rescans the model's and torch's objects again and again (8B: ~2x the
    # capture's time). The few cycles wait for the collection after the block.
    with bound("recording of rank 0"), gc_paused():
        workload, first = record_meta_rank(request, out_dir, 0, world_size)
    record_s = time.perf_counter() - start
    no_memory = MemoryMeter(META).result()
    if wl.device == "fake":
        no_memory["method"] = FAKE_MEMORY_METHOD
    facts = []
    for rank in range(min(world_size, num_files or world_size)):
        path = first if rank == 0 else os.path.join(out_dir, trace_file_name(rank))
        if rank:
            link_or_copy(first, path)
        facts.append({**rank_facts(rank, world_size, workload, path, None, [], no_memory),
                      "recorded_as_rank": 0, "record_s": record_s})
    return facts
