"""The ``meta.json`` tracefleet-capture writes beside its rank traces: built (``build_meta``),
and read bounded and checked.

Only the fields tracefleet uses are checked, where they are read: every rank's measured
figures a replay reads (`check_ranks`, in pre-flight: eager iteration times, the profiler's
cost per op for host-gap calibration, threads and machine), one rank's through
`rank_seconds`, and the workload with its world size (OOM-study estimates). A malformed file
is a TraceError naming the file and the field, never a silently skipped calibration. A
folder without ``meta.json`` is no error (traces from elsewhere have none).
"""
from __future__ import annotations

import math
import os
import statistics
from datetime import datetime, timezone
from pathlib import Path

import orjson

from actors.errors import TraceError
from actors.trace import archive

META_JSON = "meta.json"
# capture's meta.json is a few KiB per rank; past this it is not that file
MAX_META_BYTES = 64 << 20
_TOO_BIG = "expected the meta.json tracefleet-capture writes (a few KiB per rank)"


def meta_path_of(folder) -> Path:
    """Where the ``meta.json`` of a trace folder is."""
    return Path(folder) / META_JSON


def read_meta(path) -> dict | None:
    """The JSON object of a ``meta.json`` file, None when there is no such file."""
    path = Path(path)
    if not path.is_file():
        return None
    data = archive.read_file(path, MAX_META_BYTES, _TOO_BIG)
    try:
        doc = orjson.loads(data)
    except orjson.JSONDecodeError as e:
        raise TraceError(path, f"invalid JSON ({e}); expected tracefleet-capture's meta.json "
                               "object") from None
    if not isinstance(doc, dict):
        raise TraceError(path, f"expected a JSON object, got {type(doc).__name__}")
    return doc


def build_meta(ranks: list[dict], out_dir: str, wall_s: float, *, world_size: int,
               workload: dict, warmup_iters: int, timing_iters: int,
               module_backward_ranges: bool) -> dict:
    """meta.json's object from what the ranks of a capture report (orchestrator/run/capture.py):
    the settings, versions, eager timings and the original's measured memory (rank order;
    times and memory null on meta and fake, where nothing is measured). ``workload`` is the
    capture's WorkloadConfig as plain values, as the file holds it."""
    first = ranks[0]
    shapes_only = workload["device"] in ("meta", "fake")
    rank_times_s = [r["iteration_time_s"] for r in ranks]
    measured = [r for r in ranks if r["peak_memory_bytes"] is not None]
    meta = {
        "world_size": world_size,
        "workload": workload,
        "num_params": first["num_params"],
        "torch_version": first["torch_version"],
        "iteration_time_s": (statistics.median(rank_times_s)
                             if None not in rank_times_s else None),
        "rank_iteration_time_s": rank_times_s,
        "memory": {
            "method": first["memory_method"],
            "peak_bytes": max((r["peak_memory_bytes"] for r in measured), default=None),
            "iteration_start_bytes": max((r["iteration_start_bytes"] for r in measured),
                                         default=None),
        },
        "warmup_iters": 1 if shapes_only else warmup_iters,
        "timing_iters": 0 if shapes_only else timing_iters,
        "module_backward_ranges": module_backward_ranges,
        "captured_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "capture_wall_s": wall_s,
        "ranks": [{"rank": r["rank"], "file": os.path.relpath(r["path"], out_dir),
                   "kineto_file": (os.path.relpath(r["kineto_path"], out_dir)
                                   if r["kineto_path"] else None),
                   "file_bytes": r["file_bytes"], "hostname": r["hostname"],
                   "num_threads": r["num_threads"], "iteration_time_s": r["iteration_time_s"],
                   "iteration_times_s": r["iteration_times_s"],
                   "peak_memory_bytes": r["peak_memory_bytes"],
                   "iteration_start_bytes": r["iteration_start_bytes"],
                   # [host ops of the profiler-only iteration linked to the ET's, of all]
                   "kineto_aligned_ops": r.get("kineto_aligned_ops"),
                   # the machine (CPU model, logical CPUs, threads per rank): a replay on
                   # another one is warned about (actors/machine.py)
                   "machine": r.get("machine"),
                   # the profiler's own cost per recorded op, for host-gap calibration
                   # (actors/capture/profiler_cost.py); null where no profile was recorded
                   "profiler_op_cost_s": (r.get("profiler_cost") or {}).get("profiler_op_cost_s"),
                   "profiler_cost": r.get("profiler_cost")} for r in ranks],
    }
    # kernel_dispatch: ops run as the GPU of workload.gpu_kernels would (cuda_dispatch.py);
    # environment: the variables the user's code read, with their values (environment_reads.py)
    for key in ("deepspeed_version", "shm_comm_op", "ds_config", "entrypoint", "mesh",
                "kernel_dispatch", "environment"):
        if key in first:
            meta[key] = first[key]
    if "recorded_as_rank" in first:  # meta/fake: one rank recorded, its trace written for all
        meta["recorded_rank"] = first["recorded_as_rank"]
    # a mesh job: each role's recording, measured where it ran (orchestrator/run/roles.py)
    recordings = [r for r in ranks if "role" in r and r["rank"] == r["recorded_as_rank"]]
    if recordings:
        meta["role_recordings"] = [
            {"role": r["role"], "rank": r["rank"], "record_s": r["record_s"],
             "peak_rss_bytes": r["record_peak_rss_bytes"],
             "peak_rss_method": r["record_peak_rss_method"], "pid": r["record_pid"],
             "node_id": r.get("node_id")}
            for r in recordings]
    return meta


def rank_entry(path, meta: dict, rank: int) -> tuple[int, dict] | None:
    """``(index, entry)`` of ``ranks[index]`` with ``"rank": rank``, None when there is none."""
    ranks = _field(path, meta, "ranks", list, "a list with one object per rank")
    for i, r in enumerate(ranks):
        if not isinstance(r, dict) or isinstance(r.get("rank"), bool) \
                or not isinstance(r.get("rank"), int) or r["rank"] < 0:
            raise TraceError(path, f"field ranks[{i}] is {_show(r)}; expected an object "
                                   "with an integer 'rank' >= 0")
    return next(((i, r) for i, r in enumerate(ranks) if r["rank"] == rank), None)


# Per-rank figures a replay reads (host-gap calibration, the machine warnings, the original
# re-timed): each absent or null, else of this form.
_RANK_FIELDS = {
    "iteration_times_s": (lambda v: isinstance(v, list) and all(map(_seconds, v)),
                          "a list of seconds (numbers > 0)"),
    "iteration_time_s": (lambda v: _seconds(v), "seconds (a number > 0)"),
    # 0 is a measurement: capture's profiled loop was no slower than its bare one (the cost
    # lost in a loaded machine's noise), so nothing is taken off
    "profiler_op_cost_s": (lambda v: _seconds(v, zero=True), "seconds (a number >= 0)"),
    "num_threads": (lambda v: type(v) is int and v >= 0, "an integer >= 0"),
    "machine": (lambda v: isinstance(v, dict), "an object (cpu_model, num_cpus, ...)"),
}


def check_ranks(path, meta: dict) -> None:
    """Every ``ranks[i]`` entry and the figures a replay reads from it (``_RANK_FIELDS``);
    TraceError naming the file and the field. Read once, before the ranks start
    (orchestrator/preflight/validate.py): a malformed figure of any rank stops the run."""
    rank_entry(path, meta, -1)  # the list and every entry's integer rank
    for i, entry in enumerate(meta["ranks"]):
        for key, (ok, expected) in _RANK_FIELDS.items():
            value = entry.get(key)
            if value is not None and not ok(value):
                raise TraceError(path, f"field ranks[{i}].{key} is {_show(value)}; expected "
                                       f"{expected}")


def rank_seconds(path, meta: dict, rank: int, key: str) -> float | None:
    """``ranks[i].<key>`` of the entry with ``rank`` as seconds (a number > 0, or the form
    ``_RANK_FIELDS`` gives the key); None when the rank has no entry or the field is absent or
    null (not measured)."""
    found = rank_entry(path, meta, rank)
    value = found[1].get(key) if found else None
    if value is None:
        return None
    ok, expected = _RANK_FIELDS.get(key, (_seconds, "seconds (a number > 0)"))
    if not ok(value):
        raise TraceError(path, f"field ranks[{found[0]}].{key} is {_show(value)}; expected "
                               f"{expected}")
    return float(value)


def environment_changes(path, meta: dict) -> list[str]:
    """``NAME (was 'a', now 'b')`` for each variable of ``environment`` (the ones the user's
    code read at capture, actors/capture/environment_reads.py) whose value is not the same in
    this process's environment now; [] without the field."""
    recorded = meta.get("environment") or {}
    if not isinstance(recorded, dict) or not all(
            isinstance(k, str) and (v is None or isinstance(v, str)) for k, v in recorded.items()):
        raise TraceError(path, f"field 'environment' is {_show(recorded)}; expected an object "
                               "of variable names to their values (strings or null)")
    return [f"{name} (was {value!r}, now {os.environ.get(name)!r})"
            for name, value in sorted(recorded.items()) if os.environ.get(name) != value]


def workload(path, meta: dict) -> tuple[dict, int]:
    """``(workload fields, world_size)`` of a capture's meta.json."""
    fields = _field(path, meta, "workload", dict, "an object of tracefleet-capture's workload "
                                                  "settings")
    return fields, world_size(path, meta)


def world_size(path, meta: dict) -> int:
    """The ``world_size`` a capture's meta.json records."""
    world = _field(path, meta, "world_size", int, "an integer >= 1")
    if isinstance(world, bool) or world < 1:
        raise TraceError(path, f"field 'world_size' is {_show(world)}; expected an integer >= 1")
    return world


def recorded_world_size(folder) -> int | None:
    """The world size of the capture in ``folder`` (its meta.json), None without one."""
    path = meta_path_of(folder)
    meta = read_meta(path) if Path(folder).is_dir() else None
    return world_size(path, meta) if meta is not None and "world_size" in meta else None


def _field(path, meta: dict, key: str, kind: type, expected: str):
    if key not in meta:
        raise TraceError(path, f"field {key!r} is missing; expected {expected}")
    value = meta[key]
    if not isinstance(value, kind):
        raise TraceError(path, f"field {key!r} is {_show(value)}; expected {expected}")
    return value


def _seconds(t, zero: bool = False) -> bool:
    return isinstance(t, (int, float)) and not isinstance(t, bool) \
        and (0 <= t if zero else 0 < t) and t < math.inf


def _show(value) -> str:
    """A field's value as JSON (as it reads in the file), cut to 60 characters."""
    return orjson.dumps(value).decode()[:60]
