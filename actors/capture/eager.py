"""The original workload, timed again: a rank actor that trains a capture workload eagerly.

A replay's time ratio against the ``meta.json`` of a capture compares two measurements taken
on another machine or hours apart, and this machine's speed drifts. ``EagerActor`` re-runs
the capture's workload (same config, same world size, trained the same way: warm-up, then
timed iterations with nothing attached), so a benchmark can time the original and the replay
alternately in one run (scripts/bench_fidelity.py). The process group and the model live
across ``time_iterations`` calls: training goes on from round to round, as it would have.
"""
from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from actors.capture.request import CaptureRequest
from actors.capture.worker import rank_device, rendezvous_env, time_iterations, warm_up
from actors.capture.workloads.build import build_workload
from actors.errors import ConfigError
from actors.rank_base import RankWorkerBase


class EagerActor(RankWorkerBase):
    """One rank of the original workload; the driver wraps it with ``ray.remote``."""

    _workload = None
    _device = None

    def build(self, request: CaptureRequest) -> int:
        """Join the group, build ``request``'s workload (its ``num_threads`` and
        ``dist_timeout_s`` too) and warm it up for ``warmup_iters``; returns the rank. The
        rendezvous env comes from the driver's setup()."""
        rank, world_size = rendezvous_env()
        wl_cfg = request.workload
        if wl_cfg.device == "meta":
            raise ConfigError("the original of a meta capture cannot be timed: nothing runs")
        if request.num_threads > 0:
            torch.set_num_threads(request.num_threads)
        self._device = rank_device(wl_cfg, rank)
        dist.init_process_group("nccl" if self._device.type == "cuda" else "gloo", rank=rank,
                                world_size=world_size,
                                timeout=timedelta(seconds=request.dist_timeout_s))
        self._workload = build_workload(wl_cfg, rank, world_size, self._device)
        warm_up(self._workload, request.warmup_iters)
        return rank

    def time_iterations(self, num_iters: int) -> list[float]:
        """Seconds of each of ``num_iters`` more training iterations, timed as capture times
        them (worker.time_iterations)."""
        if self._workload is None:
            raise ConfigError(f"rank {os.environ.get('RANK')}: build() the workload first")
        return time_iterations(self._workload, num_iters, self._device)

    def close(self) -> None:
        """Leave the process group (the actor can then be killed)."""
        if dist.is_initialized():
            dist.destroy_process_group()
        self._workload = None
