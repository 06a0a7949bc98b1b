"""The per-rank capture procedure: join the group, build, measure memory, time, record.

Runs the same inside a Ray actor (:mod:`actors.capture.actor`) or a plain process; it only
needs the usual env rendezvous variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, and
LOCAL_RANK on cuda). Order on every rank:

1. the memory meter starts (CPU: before the model exists, see actors/capture/memory.py);
2. the workload is built and warmed up; the last warm-up iteration is the measured one;
3. ``timing_iters`` iterations are timed with nothing attached;
4. on real devices, the profiler's own cost per op is measured (one rank at a time,
   actors/capture/profiler_cost.py);
5. one iteration is recorded by the ET observer, on real devices with the profiler, then a
   few bare ones by the profiler alone (``rank-<r>.kineto.json.gz``: the host time between
   ops, see actors/capture/host_profile.py).
"""
from __future__ import annotations

import os
import socket
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from actors.trace.conventions import kineto_file_name, trace_file_name
from actors.capture.memory import MemoryMeter
from actors.capture.profiler_cost import profiler_op_cost
from actors.capture.request import CaptureRequest
from actors.capture.recorder import profiler_activities, record_iteration
from actors.capture.workloads.context import Workload
from actors.capture.workloads.mesh import build_mesh
from actors.capture.workloads.build import WorkloadConfig, build_workload
from actors.errors import ConfigError
from actors.machine import machine_info

REQUIRED_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def rendezvous_env() -> tuple[int, int]:
    """(RANK, WORLD_SIZE) from the worker group's env; ConfigError naming what is missing."""
    missing = [name for name in REQUIRED_ENV if not os.environ.get(name)]
    if missing:
        raise ConfigError(f"capture rank: environment variable(s) {', '.join(missing)} not set; "
                          "run_capture expects the worker group's rendezvous env")
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def rank_device(wl_cfg: WorkloadConfig, rank: int) -> torch.device:
    """The rank's device for ``wl_cfg.device`` (cuda: LOCAL_RANK's GPU, made current)."""
    if wl_cfg.device != "cuda":
        return torch.device(str(wl_cfg.device))
    if not torch.cuda.is_available():
        raise ConfigError(f"workload.device=cuda, but capture rank {rank} on "
                          f"{socket.gethostname()} sees no CUDA device")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    return device


def run_capture(request: CaptureRequest, out_dir: str) -> dict:
    """Capture one rank's trace of ``request`` into ``out_dir``; returns its facts (see
    :func:`rank_facts`)."""
    rank, world_size = rendezvous_env()
    wl_cfg = request.workload
    warmup_iters, timing_iters = request.warmup_iters, request.timing_iters
    if request.num_threads > 0:
        torch.set_num_threads(request.num_threads)
    os.makedirs(out_dir, exist_ok=True)
    device = rank_device(wl_cfg, rank)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank,
                            world_size=world_size,
                            timeout=timedelta(seconds=request.dist_timeout_s))
    try:
        # 1-D: reuses the default group, no new one; N-D: workload.parallelism's mesh
        mesh = build_mesh(device.type, wl_cfg.parallelism, world_size)
        meter = MemoryMeter(device)
        meter.start()
        try:
            workload = build_workload(wl_cfg, rank, world_size, device, mesh)
            warm_up(workload, warmup_iters, meter)
        finally:
            meter.stop()
        times_s = time_iterations(workload, timing_iters, device)
        record_kineto = request.record_kineto
        profiler_cost = _profiler_cost(rank, world_size) if record_kineto else None
        path = os.path.join(out_dir, trace_file_name(rank))
        kineto = os.path.join(out_dir, kineto_file_name(rank)) if record_kineto else None
        recorded = record_iteration(
            workload.step, workload.next_batch(), workload.model,
            step_index=warmup_iters + timing_iters, out_path=path,
            module_backward=request.module_backward_ranges, kineto_path=kineto,
            # the observer reads an integral tensor's range with .item(), which a DTensor (tp's
            # embedding input) refuses: the observer would stop recording there
            tensor_ranges=wl_cfg.parallelism.is_one_dim())
        dist.barrier()
    finally:
        dist.destroy_process_group()
    facts = rank_facts(rank, world_size, workload, path, kineto, times_s, meter.result())
    if kineto:
        facts["kineto_aligned_ops"] = [recorded["aligned_host_ops"], recorded["et_host_ops"]]
        facts["profiler_cost"] = profiler_cost
    return facts


def _profiler_cost(rank: int, world_size: int) -> dict:
    """The profiler's cost per recorded op on this rank (actors/capture/profiler_cost.py),
    one rank at a time so no rank's loop is preempted by another's."""
    cost = None
    for turn in range(world_size):
        if turn == rank:
            cost = profiler_op_cost(profiler_activities())
        dist.barrier()
    return cost


def time_iterations(workload: Workload, num_iters: int, device: torch.device) -> list[float]:
    """Seconds of each of ``num_iters`` training iterations with nothing attached; the ranks
    start together (so no rank waits for a late peer) and leave together."""
    dist.barrier()
    times_s = []
    for _ in range(num_iters):
        batch = workload.next_batch()
        start = time.perf_counter()
        workload.step(batch)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times_s.append(time.perf_counter() - start)
    dist.barrier()
    return times_s


def warm_up(workload: Workload, num_iters: int, meter: MemoryMeter | None = None) -> None:
    """Run ``num_iters`` untimed iterations; the last one inside ``meter.iteration()``."""
    for i in range(num_iters):
        batch = workload.next_batch()
        if meter is not None and i == num_iters - 1:
            with meter.iteration():
                workload.step(batch)
        else:
            workload.step(batch)


def rank_facts(rank: int, world_size: int, workload: Workload, path: str, kineto: str | None,
               times_s: list[float], memory: dict) -> dict:
    """What a rank reports for meta.json (times and memory None where not measured)."""
    return {
        "rank": rank,
        "world_size": world_size,
        "hostname": socket.gethostname(),
        "path": os.path.abspath(path),
        "file_bytes": os.path.getsize(path),
        "kineto_path": os.path.abspath(kineto) if kineto else None,
        "iteration_time_s": statistics.median(times_s) if times_s else None,
        "iteration_times_s": times_s,
        "peak_memory_bytes": memory["peak_memory_bytes"],
        "iteration_start_bytes": memory["iteration_start_bytes"],
        "memory_method": memory["method"],
        "num_params": workload.num_params,
        "num_threads": torch.get_num_threads(),
        "machine": machine_info(),
        "torch_version": torch.__version__,
        **workload.info,
    }
