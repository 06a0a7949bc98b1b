"""Replay configuration (one dataclass per concern; the driver composes them for Hydra)."""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from actors.choices import Choice
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

    # pre_allocate: storages no replayed op produces (parameters, optimizer state, inputs)
    # are allocated before the first iteration and kept; every intermediate lives until the
    # end of the iteration (the reference replayer's behaviour). lazy: every storage is
    # allocated at first use and freed right after its last use, parameters included (they
    # are re-created every iteration). faithful: what the original run did: storages alive
    # before the iteration (first seen as inputs) are allocated up front and kept across
    # iterations; every other storage is freed right after its last use. faithful is the
    # default (what the original held); pre_allocate and lazy are the reference modes.
    mode: AllocationMode = AllocationMode.faithful
    # Fraction of device capacity in (0, 1]. Before an op, if the bytes held plus the bytes
    # the op needs would cross threshold x capacity, outstanding collectives are completed
    # and held storages are flushed (lazy: all of them; faithful: all but the persistent
    # ones); later uses re-materialize them. 1.0 disables flushing.
    device_memory_threshold: float = 1.0

    def __post_init__(self):
        self.mode = AllocationMode.coerce(self.mode, "replay.allocation.mode")


@dataclass
class ReplayConfig:
    """What a rank replays and how."""

    # full: operators and collectives; compute: operators only; comms: collectives only.
    mode: ReplayMode = ReplayMode.full
    # auto picks cuda when the rank has a GPU, else cpu. meta runs every op on meta tensors:
    # no compute and no memory, same accounting (dry runs of models larger than the machine).
    device: Device = Device.auto
    allocation: AllocationConfig = field(default_factory=AllocationConfig)
    # Device capacity for memory accounting, e.g. "16GiB". null: the GPU's total memory on
    # cuda, physical RAM on cpu, unlimited on meta. Smaller values emulate a smaller GPU.
    device_memory_capacity: str | None = None
    # Untimed iterations before the measured ones.
    warmup_iters: int = 1
    # Measured iterations (the fewest, when replay.min_time_s > 0). At least 6 give the
    # median iteration time a 95% confidence interval (actors/replay/timed_iterations.py);
    # 20 keep it within about +-5% on the demos here (docs/timing.md).
    iters: int = 20
    # > 0: time iterations past replay.iters until their total reaches this and the 95%
    # interval of the median is within replay.ci_target of it, or replay.max_iters (as
    # timeit's autorange). Every rank stops after the same iteration: the decision is taken
    # on the slowest rank's time per iteration, all-reduced over the world group.
    min_time_s: float = 0.0
    # With replay.min_time_s > 0: the interval's largest distance from the median, relative
    # to it, at which timing stops (0.05: within +-5%).
    ci_target: float = 0.05
    # With replay.min_time_s > 0: the cap on measured iterations.
    max_iters: int = 200
    # Measure the peak of real allocations, op temporaries included, in every timed
    # iteration. cpu: a counter of the CPU allocator's live bytes in every thread (docs/
    # memory.md; needs a C++ compiler once); cuda: the caching allocator's peak stats. meta
    # cannot measure: the accounted peak is then reported alone.
    measure_memory: bool = True
    # Time every op (the top-ops table); off, only collectives and whole iterations are timed,
    # which keeps the op loop's host overhead low.
    per_op_timing: bool = False
    # Reproduce the CPU time the original spent between consecutive ops (Python, framework
    # hooks), read from the profiler trace recorded at capture (rank-<r>.kineto.json.gz),
    # by busy-waiting before each op. For framework-heavy runs (DeepSpeed ZeRO-3).
    host_gaps: bool = False
    # meta: the first iteration runs every op's meta kernel; later ones rebuild the outputs
    # it saw (fresh tensors of the same shapes and strides, or the input an in-place op
    # returns) without the kernel, 10-100x cheaper; views and ops that change an input's
    # metadata keep their kernel (actors/replay/ops/meta_outputs.py). Accounting is unchanged.
    meta_recorded_outputs: bool = True
    # Turn output shape/dtype mismatches into errors instead of counting them.
    strict: bool = False
    # Write a torch profiler trace per rank (Perfetto/TensorBoard-viewable) into the run dir.
    profile: bool = False
    # Points kept in the per-rank memory timeline (downsampled beyond this).
    timeline_max_points: int = 2000
    # With a target: keep the caching allocator model's history and write it per rank as
    # snapshot_rank<r>.pickle in the layout torch.cuda.memory._snapshot() returns (for
    # pytorch.org/memory_viz and tracefleet-compare; actors/replay/memory/snapshot.py).
    allocator_snapshot: bool = False
    # With a target: the model's allocated bytes by category and its reserved bytes over the
    # last iteration, and both peaks (prediction.html; tracefleet-predict turns it on).
    allocator_timeline: bool = False
    # Bound on one collective (and the process-group rendezvous), seconds.
    collective_timeout_s: float = 120.0
    # cuda: synchronize the device around every collective so its time is the transfer's
    # own. Off by default: it removes the original's compute/communication overlap.
    cuda_sync_collectives: bool = False

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


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "pb": 10**15,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "pib": 2**50}


def parse_bytes(text, key: str = "replay.device_memory_capacity") -> int:
    """Parse '16GiB', '512MB', '1e9' or an int into bytes (``key`` names the setting in errors)."""
    if isinstance(text, (int, float)):
        return int(text)
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ConfigError(f"{key}={text!r}; expected a size like '16GiB' or '512MB'")
    try:
        return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    except ValueError:
        raise ConfigError(f"{key}={text!r}; bad number") from None
