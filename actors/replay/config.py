"""Replay configuration (one dataclass per concern; the driver composes them for Hydra)."""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from actors.errors import ConfigError

MODES = ("full", "compute", "comms")
ALLOCATION_MODES = ("pre_allocate", "lazy")
DEVICES = ("auto", "cpu", "cuda", "meta")


@dataclass
class AllocationConfig:
    """How the replayer holds tensor memory."""

    # pre_allocate: tensors no replayed op produces are allocated before the first iteration
    # and kept; intermediates live until the end of the iteration (the reference replayer's
    # behaviour). lazy: every storage is allocated at first use and freed right after its
    # last use (liveness computed once from the trace).
    mode: str = "pre_allocate"
    # Fraction of device capacity in (0, 1]. In lazy mode, before an op, if held bytes /
    # capacity exceed it, outstanding collectives are completed and every held storage is
    # freed (later uses regenerate it). 1.0 disables flushing.
    device_memory_threshold: float = 1.0


@dataclass
class ReplayConfig:
    """What a rank replays and how."""

    # full: operators and collectives; compute: operators only; comms: collectives only.
    mode: str = "full"
    # auto picks cuda when the rank has a GPU, else cpu. meta runs every op on meta tensors:
    # no compute and no memory, same accounting (dry runs of models larger than the machine).
    device: str = "auto"
    allocation: AllocationConfig = field(default_factory=AllocationConfig)
    # Device capacity for memory accounting, e.g. "16GiB". null: the GPU's total memory on
    # cuda, physical RAM on cpu, unlimited on meta. Smaller values emulate a smaller GPU.
    device_memory_capacity: str | None = None
    # Untimed iterations before the measured ones.
    warmup_iters: int = 1
    # Measured iterations.
    iters: int = 3
    # Turn output shape/dtype mismatches into errors instead of counting them.
    strict: bool = False
    # Write a torch profiler trace per rank (Perfetto/TensorBoard-viewable) into the run dir.
    profile: bool = False
    # Points kept in the per-rank memory timeline (downsampled beyond this).
    timeline_max_points: int = 2000
    # Bound on one collective (and the process-group rendezvous), seconds.
    collective_timeout_s: float = 120.0

    def validate(self) -> None:
        """Raise ConfigError on values outside their domain."""
        if self.mode not in MODES:
            raise ConfigError(f"replay.mode={self.mode!r}; expected one of {MODES}")
        if self.device not in DEVICES:
            raise ConfigError(f"replay.device={self.device!r}; expected one of {DEVICES}")
        if self.allocation.mode not in ALLOCATION_MODES:
            raise ConfigError(f"replay.allocation.mode={self.allocation.mode!r}; "
                              f"expected one of {ALLOCATION_MODES}")
        t = self.allocation.device_memory_threshold
        if not 0 < t <= 1:
            raise ConfigError(f"replay.allocation.device_memory_threshold={t}; expected a fraction in (0, 1]")
        if t < 1 and self.allocation.mode != "lazy":
            raise ConfigError("replay.allocation.device_memory_threshold < 1 needs "
                              "replay.allocation.mode=lazy (pre-allocated memory is never flushed)")
        if self.iters < 1 or self.warmup_iters < 0:
            raise ConfigError(f"replay.iters={self.iters}, replay.warmup_iters={self.warmup_iters}; "
                              "expected iters >= 1 and warmup_iters >= 0")
        if self.device == "meta" and self.mode != "compute":
            raise ConfigError(f"replay.device=meta runs operators only; set replay.mode=compute "
                              f"(got replay.mode={self.mode})")
        if self.device_memory_capacity is not None:
            parse_bytes(self.device_memory_capacity)


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text) -> int:
    """Parse '16GiB', '512MB', '1e9' or an int into bytes."""
    if isinstance(text, (int, float)):
        return int(text)
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ConfigError(f"replay.device_memory_capacity={text!r}; expected a size like '16GiB' or '512MB'")
    try:
        return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    except ValueError:
        raise ConfigError(f"replay.device_memory_capacity={text!r}; bad number") from None
