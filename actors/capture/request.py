"""What every rank of a capture runs: ``CaptureRequest``, the workload and how it is trained,
timed and recorded.

The driver makes it from its config (orchestrator/run/capture.py's ``CaptureConfig.request``)
and hands the object itself to a rank recorded in this process, in a worker process or in a
Ray actor (each pickles it: nothing is turned into a dict on the way). Plain values become a
request only where a process gets no Python object: ``from_dict`` (a meta.json's workload, a
test's JSON).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from actors.capture.workloads.config import WorkloadConfig
from actors.errors import ConfigError


@dataclass(frozen=True)
class CaptureRequest:
    """One capture's per-rank settings (validated by the driver's config)."""

    workload: WorkloadConfig
    # untimed, unrecorded iterations; the last one is measured for memory
    warmup_iters: int = 3
    timing_iters: int = 5  # timed without the observer
    num_threads: int = 0  # torch intra-op threads; 0 keeps torch's default
    dist_timeout_s: float = 300.0  # one collective's timeout
    module_backward_ranges: bool = True  # also mark each module's backward
    record_kineto: bool = True  # also write the profiler trace (real devices)

    @classmethod
    def from_dict(cls, data: Mapping) -> "CaptureRequest":
        """The request of plain values (``workload`` a mapping of WorkloadConfig fields);
        ConfigError naming an unknown key."""
        known = {f.name for f in dataclasses.fields(cls)}
        _refuse_unknown("capture", set(data) - known, known)
        workload = dict(data.get("workload") or {})
        fields = WorkloadConfig.__dataclass_fields__
        _refuse_unknown("workload", set(workload) - set(fields), fields)
        return cls(**{**data, "workload": WorkloadConfig(**workload)})


def _refuse_unknown(what: str, unknown: set[str], known) -> None:
    if unknown:
        raise ConfigError(f"unknown {what} key(s) {', '.join(sorted(unknown))}; "
                          f"expected some of {', '.join(known)}")
