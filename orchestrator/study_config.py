"""The studies' sections of the run config (``experiment.min_memory``, ``experiment.oom_study``).

They sit on the ground floor, below orchestrator/config.py which composes them into
``ExperimentConfig``, so the config never imports the studies that read it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from actors.config_fields import setting
from actors.errors import ConfigError
from actors.replay.config import AllocationMode, parse_bytes


@dataclass
class MinMemoryConfig:
    """The minimum-memory search (``experiment.search=min_memory``)."""

    allocation_modes: list[AllocationMode] = setting(factory=list, help=(
        "Allocation modes searched one after another; empty: replay.allocation.mode alone."))
    thresholds: list[float] = setting(factory=list, help=(
        "Flush thresholds searched for lazy and faithful (pre_allocate never flushes, so it is "
        "searched at 1.0 only); empty: replay.allocation.device_memory_threshold alone."))
    tolerance: float = setting(0.01, help=(
        "Stop when the smallest completing and the largest failing capacity are within "
        "max(tolerance x the completing one, tolerance_bytes)."))
    tolerance_bytes: int = setting(4096, help="The tolerance's floor in bytes (see tolerance).")
    max_steps: int = setting(40, help=(
        "Bound on the replays of one (mode, threshold) search, the reference included."))

    def validate(self) -> None:
        """Raise ConfigError on values outside their domain."""
        if not 0 <= self.tolerance < 1 or self.tolerance_bytes < 1:
            raise ConfigError(f"experiment.min_memory.tolerance={self.tolerance}, tolerance_bytes="
                              f"{self.tolerance_bytes}; expected 0 <= tolerance < 1 and "
                              f"tolerance_bytes >= 1")
        if self.max_steps < 3:
            raise ConfigError(f"experiment.min_memory.max_steps={self.max_steps}; expected >= 3")
        bad = [t for t in self.thresholds if not 0 < t <= 1]
        if bad:
            raise ConfigError(f"experiment.min_memory.thresholds={bad}; expected fractions in (0, 1]")



@dataclass
class OomStudyConfig:
    """The OOM study (``experiment.search=oom_study``)."""

    workload: str | None = setting(None, help=(
        "A capture workload preset (conf/workload/<name>.yaml, e.g. llama_70b) traced on the "
        "meta device for the study, replacing trace.dir; null: study trace.dir as it is."))
    workload_overrides: dict[str, Any] = setting(factory=dict, help=(
        "Workload fields over the preset's, e.g. {parallel: local, seq_len: 2048}."))
    capture_world_size: int = setting(1, help=(
        "Ranks captured. parallel=local workloads give every rank the same trace: 1 rank with "
        "zero3.world_size=N replays rank 0 of an N-rank ZeRO-3 job."))
    trace_cache_dir: str = setting("~/.cache/tracefleet/traces", help=(
        "Captured traces are kept here, one folder per workload, and reused by later studies."))
    device_memory_capacity: str = setting("80GiB", help=(
        "The emulated device every mode is replayed on first, e.g. \"80GiB\"."))
    allocation_modes: list[AllocationMode] = setting(factory=lambda: [
        AllocationMode.pre_allocate, AllocationMode.faithful, AllocationMode.lazy], help=(
        "Allocation modes replayed on the device and searched for their minimum capacity."))
    flush_mode: AllocationMode = setting(AllocationMode.lazy, help=(
        "The flush demonstration: this mode at flush_capacity, without a threshold and with "
        "each of flush_thresholds. null flush_capacity: flush_mode's minimum capacity with the "
        "first of flush_thresholds (searched)."))
    flush_thresholds: list[float] = setting(factory=lambda: [0.5], help=(
        "Thresholds of the flush demonstration (fractions in (0, 1); see flush_mode)."))
    flush_capacity: str | None = setting(None, help=(
        "The device of the flush demonstration, e.g. \"40GiB\"; null: searched (see flush_mode)."))
    gpus_per_node: int = setting(8, help=(
        "GPUs per node for DeepSpeed's estimate (nodes = world size / this; the world size is "
        "zero3.world_size when set, else the trace's)."))

    def __post_init__(self):
        self.flush_mode = AllocationMode.coerce(self.flush_mode, "experiment.oom_study.flush_mode")
        self.allocation_modes = [AllocationMode.coerce(m, "experiment.oom_study.allocation_modes")
                                 for m in self.allocation_modes]

    def validate(self) -> None:
        """Raise ConfigError on values outside their domain or inconsistent with each other."""
        key = "experiment.oom_study"
        if not self.allocation_modes:
            raise ConfigError(f"{key}.allocation_modes is empty; expected at least one mode")
        if self.flush_mode == AllocationMode.pre_allocate:
            raise ConfigError(f"{key}.flush_mode=pre_allocate never flushes; expected lazy or "
                              "faithful")
        bad = [t for t in self.flush_thresholds if not 0 < t < 1]
        if not self.flush_thresholds or bad:
            raise ConfigError(f"{key}.flush_thresholds={list(self.flush_thresholds)}; expected "
                              "one or more fractions in (0, 1)")
        for name in ("device_memory_capacity", "flush_capacity"):
            value = getattr(self, name)
            if value is not None and parse_bytes(value, f"{key}.{name}") <= 0:
                raise ConfigError(f"{key}.{name}={value!r}; expected a positive size")
        if self.capture_world_size < 1 or self.gpus_per_node < 1:
            raise ConfigError(f"{key}.capture_world_size={self.capture_world_size}, "
                              f"gpus_per_node={self.gpus_per_node}; expected >= 1")
