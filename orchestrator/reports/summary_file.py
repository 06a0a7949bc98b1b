"""Reading a run's ``summary.json`` without trusting it: a run dir can come from another
machine, an older tracefleet or a hand edit, and ``tracefleet-report`` plots what it holds.

The fields are checked by the names the project gives them (a count is ``num_*``, a byte
figure ``*_bytes``, a duration ``*_s``), so a field added later is checked without a line
here; the few structures the page draws (``ranks``, each rank's ``memory_timeline`` and
``flush_ticks``) are checked by shape. A refusal is a ResultsError naming the file and the
field (``ranks[0].iteration_time_s: 'fast' is not a duration in seconds``).
"""
from __future__ import annotations

import math
from pathlib import Path

from orchestrator.errors import ResultsError
from orchestrator.outputs import RunDir
from orchestrator.results import read_json
from orchestrator.run_summary import RunSummary

_MAX_BYTES = 1 << 63
_SHOWN_CHARS = 40


def read_summary(run_dir: Path) -> RunSummary:
    """The checked summary of ``run_dir`` (see the module docstring) as its record."""
    path = RunDir(run_dir).summary
    summary = read_json(path, "a run summary")
    if not isinstance(summary, dict):
        raise ResultsError(f"{path}: a run summary is a JSON object; this file holds a "
                           f"{type(summary).__name__}")
    check_summary(summary, path)
    return RunSummary.from_dict(summary, path)


def check_summary(summary: dict, path) -> None:
    """Refuse the first field of ``summary`` (or of one of its ranks) that is not what its
    name says it is."""
    _check_fields(summary, "", path)
    ranks = summary.get("ranks")
    if ranks is None:
        return
    if not isinstance(ranks, list):
        _refuse(path, "ranks", ranks, "is not a list of rank reports")
    for i, rank in enumerate(ranks):
        where = f"ranks[{i}]"
        if not isinstance(rank, dict):
            _refuse(path, where, rank, "is not a rank report (a JSON object)")
        if type(rank.get("rank")) is not int or rank["rank"] < 0:
            _refuse(path, f"{where}.rank", rank.get("rank"), "is not a rank (an integer >= 0)")
        _check_fields(rank, f"{where}.", path)
        timeline = rank.get("memory_timeline")
        if timeline is not None and not (isinstance(timeline, list) and all(
                isinstance(p, list) and 2 <= len(p) <= 4 and all(map(_is_number, p))
                for p in timeline)):
            _refuse(path, f"{where}.memory_timeline", timeline,
                    "is not a memory timeline (a list of [op_index, bytes, ...] points)")
        ticks = rank.get("flush_ticks")
        if ticks is not None and not (isinstance(ticks, list) and all(
                type(t) is int for t in ticks)):
            _refuse(path, f"{where}.flush_ticks", ticks, "is not a list of op indices")


def _check_fields(obj: dict, prefix: str, path) -> None:
    for key, value in obj.items():
        if value is None or key == "ranks":
            continue
        if key.endswith("_bytes") and not _is_byte_count(value):
            _refuse(path, prefix + key, value, "is not a byte count (an integer >= 0)")
        elif key.endswith("_s") and not _is_seconds(key, value):
            _refuse(path, prefix + key, value, f"is not {_SECONDS_SHAPE[_seconds_shape(key)]}")
        elif key.startswith("num_") and not (_is_count(value) or isinstance(value, dict) and
                                             all(map(_is_count, value.values()))):
            _refuse(path, prefix + key, value, "is not a count (an integer >= 0)")
        elif key in ("coverage", "device_memory_threshold", "skew") and not (
                _is_number(value) and value >= 0):
            _refuse(path, prefix + key, value, "is not a number >= 0")
        elif key in ("status", "mode", "allocation_mode", "error") and \
                not isinstance(value, str):
            _refuse(path, prefix + key, value, "is not a string")


def _is_number(value) -> bool:
    return type(value) in (int, float) and math.isfinite(value)


def _is_byte_count(value) -> bool:
    return type(value) is int and 0 <= value < _MAX_BYTES


def _is_count(value) -> bool:
    return type(value) is int and value >= 0


# ``*_times_s``: one duration per iteration; ``*timings_s`` / ``*_stats_s``: named durations.
_SECONDS_SHAPE = {list: "a list of durations in seconds (numbers >= 0)",
                  dict: "an object of durations in seconds (numbers >= 0)",
                  float: "a duration in seconds (a number >= 0)"}


def _seconds_shape(key: str) -> type:
    if key.endswith("times_s"):
        return list
    return dict if key.endswith(("timings_s", "stats_s")) else float


def _is_seconds(key: str, value) -> bool:
    def one(v):
        return _is_number(v) and v >= 0

    shape = _seconds_shape(key)
    if shape is list:
        return isinstance(value, list) and all(map(one, value))
    if shape is dict:
        return isinstance(value, dict) and all(v is None or one(v) for v in value.values())
    return one(value)


def _refuse(path, field: str, value, what: str):
    if isinstance(value, (dict, list)):
        shown = f"a {'JSON object' if isinstance(value, dict) else 'list'}"
    else:
        shown = repr(value)
        shown = shown if len(shown) <= _SHOWN_CHARS else shown[:_SHOWN_CHARS - 3] + "..."
    raise ResultsError(f"{path}: {field}: {shown} {what}")
