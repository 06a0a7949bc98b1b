"""The per-rank capture procedure: join the gloo group, train, time, record one iteration.

Runs the same inside a Ray actor (:mod:`actors.capture.actor`) or a plain process; it only
needs the usual env rendezvous variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT).
"""
from __future__ import annotations

import os
import socket
import statistics
import time
from collections.abc import Mapping
from datetime import timedelta

import torch
import torch.distributed as dist

from actors.capture import trace_file_name
from actors.capture.recorder import record_iteration
from actors.capture.workloads import WorkloadConfig, build_workload
from actors.errors import ConfigError

REQUIRED_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def workload_config(cfg: Mapping) -> WorkloadConfig:
    """The WorkloadConfig of a capture config's ``workload`` mapping (unknown keys rejected)."""
    raw = dict(cfg.get("workload") or {})
    known = WorkloadConfig.__dataclass_fields__
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise ConfigError(f"unknown workload key(s) {', '.join(unknown)}; "
                          f"expected some of {', '.join(known)}")
    return WorkloadConfig(**raw)


def _rendezvous_env() -> tuple[int, int]:
    missing = [name for name in REQUIRED_ENV if not os.environ.get(name)]
    if missing:
        raise ConfigError(f"capture rank: environment variable(s) {', '.join(missing)} not set; "
                          "run_capture expects the worker group's rendezvous env")
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def run_capture(cfg: Mapping, out_dir: str) -> dict:
    """Capture one rank's trace into ``out_dir/rank-<r>.et.json.gz``; returns its facts.

    cfg keys: ``workload`` (WorkloadConfig fields), ``warmup_iters`` (untimed, unrecorded),
    ``timing_iters`` (timed without the observer), ``num_threads`` (torch intra-op threads;
    0 keeps torch's default), ``dist_timeout_s`` (gloo collective timeout),
    ``module_backward_ranges`` (also wrap module backward in ranges).
    """
    rank, world_size = _rendezvous_env()
    wl_cfg = workload_config(cfg)
    # Counts come from CaptureConfig.rank_cfg(), validated on the driver.
    warmup_iters = int(cfg.get("warmup_iters", 3))
    timing_iters = int(cfg.get("timing_iters", 5))
    if int(cfg.get("num_threads", 0)) > 0:
        torch.set_num_threads(int(cfg["num_threads"]))
    os.makedirs(out_dir, exist_ok=True)
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=float(cfg.get("dist_timeout_s", 300))))
    try:
        workload = build_workload(wl_cfg, rank, world_size)
        for _ in range(warmup_iters):
            workload.step(workload.next_batch())
        dist.barrier()  # start timing together so no rank waits for a late peer
        times_s = []
        for _ in range(timing_iters):
            batch = workload.next_batch()
            start = time.perf_counter()
            workload.step(batch)
            times_s.append(time.perf_counter() - start)
        dist.barrier()
        path = os.path.join(out_dir, trace_file_name(rank))
        record_iteration(workload.step, workload.next_batch(), workload.model,
                         step_index=warmup_iters + timing_iters, out_path=path,
                         module_backward=bool(cfg.get("module_backward_ranges", True)))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return {
        "rank": rank,
        "world_size": world_size,
        "hostname": socket.gethostname(),
        "path": os.path.abspath(path),
        "file_bytes": os.path.getsize(path),
        "iteration_time_s": statistics.median(times_s),
        "iteration_times_s": times_s,
        "num_params": workload.num_params,
        "num_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        **workload.info,
    }
