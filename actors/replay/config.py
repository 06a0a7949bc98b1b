"""Replay configuration (one dataclass per concern; the driver composes them for Hydra)."""
from __future__ import annotations

import re
from dataclasses import dataclass

from actors.choices import Choice
from actors.config_fields import setting
from actors.errors import ConfigError


class ReplayMode(Choice):
    """What a rank replays."""

    full = "full"  # operators and collectives
    compute = "compute"  # operators only
    comms = "comms"  # collectives only


class Device(Choice):
    """Where the replay's tensors live."""

    auto = "auto"  # cuda when the rank has a GPU, else cpu
    cpu = "cpu"
    cuda = "cuda"
    meta = "meta"  # shapes only: no compute, no memory, same accounting


class AllocationMode(Choice):
    """How the replay holds tensor memory (see docs/memory.md's side-by-side table)."""

    pre_allocate = "pre_allocate"  # the reference replayer: inputs up front, intermediates to the end
    lazy = "lazy"  # every storage from first to last use, parameters included
    faithful = "faithful"  # like the original: persistent storages kept, the rest freed at last use


@dataclass
class AllocationConfig:
    """How the replayer holds tensor memory."""

    mode: AllocationMode = setting(AllocationMode.faithful, help=(
        "pre_allocate: storages no replayed op produces (parameters, optimizer state, inputs) "
        "are allocated before the first iteration and kept; every intermediate lives until the "
        "end of the iteration (the reference replayer's behaviour). lazy: every storage is "
        "allocated at first use and freed right after its last use, parameters included (they "
        "are re-created every iteration). faithful: what the original run did: storages alive "
        "before the iteration (first seen as inputs) are allocated up front and kept across "
        "iterations; every other storage is freed right after its last use. faithful is the "
        "default (what the original held); pre_allocate and lazy are the reference modes."))
    device_memory_threshold: float = setting(1.0, help=(
        "Fraction of device capacity in (0, 1]. Before an op, if the bytes held plus the bytes "
        "the op needs would cross threshold x capacity, outstanding collectives are completed "
        "and held storages are flushed (lazy: all of them; faithful: all but the persistent "
        "ones); later uses re-materialize them. 1.0 disables flushing."))

    def __post_init__(self):
        self.mode = AllocationMode.coerce(self.mode, "replay.allocation.mode")


@dataclass
class ReplayConfig:
    """What a rank replays and how."""

    mode: ReplayMode = setting(ReplayMode.full, help=(
        "full: operators and collectives; compute: operators only; comms: collectives only."))
    device: Device = setting(Device.auto, help=(
        "auto picks cuda when the rank has a GPU, else cpu. meta runs every op on meta tensors: "
        "no compute and no memory, same accounting (dry runs of models larger than the "
        "machine)."))
    allocation: AllocationConfig = setting(factory=AllocationConfig, help=(
        "How the replayer holds tensor memory (replay.allocation.*)."))
    device_memory_capacity: str | None = setting(None, help=(
        "Device capacity for memory accounting, e.g. \"16GiB\". null: the GPU's total memory on "
        "cuda, physical RAM on cpu, unlimited on meta. Smaller values emulate a smaller GPU."))
    warmup_iters: int = setting(1, help="Untimed iterations before the measured ones.")
    iters: int = setting(20, help=(
        "Measured iterations (the fewest, when replay.min_time_s > 0). At least 6 give the "
        "median iteration time a 95% confidence interval (actors/replay/timed_iterations.py); "
        "20 keep it within about +-5% on the demos here (docs/timing.md)."))
    min_time_s: float = setting(0.0, help=(
        "> 0: time iterations past replay.iters until their total reaches this and the 95% "
        "interval of the median is within replay.ci_target of it, or replay.max_iters (as "
        "timeit's autorange). Every rank stops after the same iteration: the decision is taken "
        "on the slowest rank's time per iteration, all-reduced over the world group."))
    ci_target: float = setting(0.05, help=(
        "With replay.min_time_s > 0: the interval's largest distance from the median, relative "
        "to it, at which timing stops (0.05: within +-5%)."))
    max_iters: int = setting(200, help=(
        "With replay.min_time_s > 0: the cap on measured iterations."))
    measure_memory: bool = setting(True, help=(
        "Measure the peak of real allocations, op temporaries included, in every timed "
        "iteration. cpu: a counter of the CPU allocator's live bytes in every thread "
        "(docs/memory.md; needs a C++ compiler once); cuda: the caching allocator's peak stats. "
        "meta "
        "cannot measure: the accounted peak is then reported alone."))
    per_op_timing: bool = setting(False, help=(
        "Time every op (the top-ops table); off, only collectives and whole iterations are "
        "timed, which keeps the op loop's host overhead low."))
    host_gaps: bool = setting(False, help=(
        "Reproduce the CPU time the original spent between consecutive ops (Python, framework "
        "hooks), read from the profiler trace recorded at capture (rank-<r>.kineto.json.gz), by "
        "busy-waiting before each op. For framework-heavy runs (DeepSpeed ZeRO-3)."))
    meta_recorded_outputs: bool = setting(True, help=(
        "meta: the first iteration runs every op's meta kernel; later ones rebuild the outputs "
        "it saw (fresh tensors of the same shapes and strides, or the input an in-place op "
        "returns) without the kernel, 10-100x cheaper; views and ops that change an input's "
        "metadata keep their kernel (actors/replay/ops/meta_outputs.py). Accounting is "
        "unchanged."))
    strict: bool = setting(False, help=(
        "Turn output shape/dtype mismatches into errors instead of counting them."))
    profile: bool = setting(False, help=(
        "Write a torch profiler trace per rank (Perfetto/TensorBoard-viewable) into the run "
        "dir."))
    timeline_max_points: int = setting(2000, help=(
        "Points kept in the per-rank memory timeline (downsampled beyond this)."))
    allocator_snapshot: bool = setting(False, help=(
        "With a target: keep the caching allocator model's history and write it per rank as "
        "snapshot_rank<r>.pickle in the layout torch.cuda.memory._snapshot() returns (for "
        "pytorch.org/memory_viz and tracefleet-compare; actors/replay/memory/snapshot.py)."))
    allocator_timeline: bool = setting(False, help=(
        "With a target: the model's allocated bytes by category and its reserved bytes over the "
        "last iteration, and both peaks (prediction.html; tracefleet-predict turns it on)."))
    collective_timeout_s: float = setting(120.0, help=(
        "Bound on one collective (and the process-group rendezvous), seconds."))
    cuda_sync_collectives: bool = setting(False, help=(
        "cuda: synchronize the device around every collective so its time is the transfer's "
        "own. Off by default: it removes the original's compute/communication overlap."))

    def __post_init__(self):
        self.mode = ReplayMode.coerce(self.mode, "replay.mode")
        self.device = Device.coerce(self.device, "replay.device")

    def validate(self) -> None:
        """Raise ConfigError on values outside their domain or inconsistent with each other."""
        t = self.allocation.device_memory_threshold
        if not 0 < t <= 1:
            raise ConfigError(f"replay.allocation.device_memory_threshold={t}; expected a fraction in (0, 1]")
        if t < 1 and self.allocation.mode == AllocationMode.pre_allocate:
            raise ConfigError("replay.allocation.device_memory_threshold < 1 needs "
                              "replay.allocation.mode=lazy or faithful (pre-allocated memory "
                              "is never flushed)")
        if self.iters < 1 or self.warmup_iters < 0:
            raise ConfigError(f"replay.iters={self.iters}, replay.warmup_iters={self.warmup_iters}; "
                              "expected iters >= 1 and warmup_iters >= 0")
        if self.min_time_s < 0 or not 0 < self.ci_target < 1:
            raise ConfigError(f"replay.min_time_s={self.min_time_s}, replay.ci_target="
                              f"{self.ci_target}; expected min_time_s >= 0 and ci_target in (0, 1)")
        if self.min_time_s > 0 and self.max_iters < self.iters:
            raise ConfigError(f"replay.max_iters={self.max_iters} < replay.iters={self.iters}: "
                              "the cap must allow the fewest iterations")
        if self.device == Device.meta and self.mode != ReplayMode.compute:
            raise ConfigError(f"replay.device=meta runs operators only; set replay.mode=compute "
                              f"(got replay.mode={self.mode})")
        if self.device_memory_capacity is not None:
            parse_bytes(self.device_memory_capacity)


def dry_run_config(allocation: AllocationMode = AllocationMode.lazy) -> ReplayConfig:
    """The meta-device dry run, defined here only: operators only, on meta (no compute, no
    memory, the same accounting); one warm-up iteration (the allocator's cache of the first is
    reused, and can fragment, in the second, as in training) and one measured; nothing measured
    (meta cannot). ``allocation``: lazy for ``replay=dry_run`` (and the studies built on it),
    faithful for tracefleet-predict (memory held as the original held it)."""
    return ReplayConfig(mode=ReplayMode.compute, device=Device.meta, warmup_iters=1, iters=1,
                        measure_memory=False, allocation=AllocationConfig(mode=allocation))

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "pb": 10**15,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "pib": 2**50}


def parse_bytes(text, key: str = "replay.device_memory_capacity") -> int:
    """Parse '16GiB', '512MB', '1e9' or an int into bytes (``key`` names the setting in errors)."""
    if isinstance(text, bool):
        raise ConfigError(f"{key}={text!r}; expected a size like '16GiB' or '512MB'")
    if isinstance(text, (int, float)):
        number = float(text)
    else:
        m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([A-Za-z]*)\s*", str(text))
        if not m or m.group(2).lower() not in _UNITS:
            raise ConfigError(f"{key}={text!r}; expected a size like '16GiB' or '512MB'")
        try:
            number = float(m.group(1)) * _UNITS[m.group(2).lower()]
        except ValueError:
            raise ConfigError(f"{key}={text!r}; bad number") from None
    # a byte count fits an int64 (an exabyte is 2**60): 1e400GiB is a typo, not a device
    if not 0 <= number < 2 ** 63:
        raise ConfigError(f"{key}={text!r}; expected a byte count from 0 to 8 EiB")
    return int(number)
