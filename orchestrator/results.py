"""The results table of a sweep or search: one row per point, each written atomically.

Layout under the root (the sweep dir, or a search's run dir)::

    rows/<id>.json      one file per point (the source of truth), written as tmp + rename
    results.csv         every row, rebuilt (tmp + rename) after each point
    results.parquet     the same table, typed

A point is identified by its overrides (sorted, so their order on the command line does not
matter); a re-run finds the row of a point it already ran (resume). Concurrent writers (the
Ray launcher runs points in parallel) are serialized on an ``flock`` while the tables are
rebuilt; the row files need no lock. A process killed mid-way loses at most the point it was
running: every finished point's row file is already on disk, the tables are replaced whole or
not at all, the lock dies with its holder (``flock``), and the temp file a killed writer left
is removed by the next rebuild. A row file that is cut or corrupt (a disk that filled, a
hand edit) is named in a warning and left out of the tables; its point counts as not run, so
a resume runs it again.
"""
from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import time
from contextlib import contextmanager
from pathlib import Path

import orjson
import psutil

from actors.choices import Choice
from actors.atomic_file import atomic_write
from orchestrator.errors import ResultsError
from orchestrator.outputs import RESULTS_CSV, RESULTS_PARQUET, ROWS_DIR
from orchestrator.status import RunStatus

log = logging.getLogger("tracefleet")

_LOCK_NAME = ".results.lock"
MAX_REASON_CHARS = 500


class RowKind(Choice):
    """What a row records (its ``kind`` column)."""

    point = "point"  # one point of a sweep (orchestrator/studies/sweep.py)
    probe = "probe"  # one replay of a minimum-memory search (orchestrator/studies/min_memory.py)
    min_memory = "min_memory"  # the answer of one minimum-memory search
    study = "study"  # one replay of the OOM study (orchestrator/studies/oom_study.py)
    estimate = "estimate"  # one of DeepSpeed's ZeRO-3 estimates in the OOM study
    fit_search_probe = "fit_search_probe"  # one prediction of a fit search (studies/fit_search.py)


class StudyPart(Choice):
    """Which part of the OOM study a ``study`` row belongs to (its ``study_part`` column)."""

    device = "device"  # every mode on the device, no flushing
    flush = "flush"  # the flush mode without and with each threshold


# Column keys every row has (make_row), and the ones the studies add.
KIND, POINT, STATUS, REASON, RUN_DIR = "kind", "point", "status", "reason", "run_dir"
STUDY_PART = "study_part"
MIN_CAPACITY, MAX_FAILING_CAPACITY = "min_capacity_bytes", "max_failing_capacity_bytes"
# Override columns the searches and the OOM study write and the reports read.
MODE = "replay.allocation.mode"
THRESHOLD = "replay.allocation.device_memory_threshold"
CAPACITY = "replay.device_memory_capacity"
# The same axes as a run summary reports them (metric columns, filled in for every point).
ALLOCATION_MODE, DEVICE_THRESHOLD = "allocation_mode", "device_memory_threshold"
DEVICE_CAPACITY_BYTES = "device_memory_capacity_bytes"

# Summary keys copied into a row as they are (absent keys stay empty).
SUMMARY_COLUMNS = (
    "world_size", "mode", ALLOCATION_MODE, DEVICE_CAPACITY_BYTES, DEVICE_THRESHOLD,
    "iteration_time_s", "iteration_time_ci_low_s",
    "iteration_time_ci_high_s", "iteration_time_min_s", "iteration_time_max_s",
    "num_timed_iterations", "iteration_time_median_s",
    "measured_peak_bytes", "accounted_peak_bytes", "peak_memory_bytes", "peak_memory_source",
    "liveness_lower_bound_bytes", "num_flushes", "flushed_bytes", "coverage",
    # the caching allocator model's prediction (a run with a target)
    "predicted_reserved_peak_bytes", "predicted_allocated_peak_bytes", "num_alloc_retries",
    "num_predicted_ooms",
)
ZERO3_COLUMNS = ("strategy", "num_allgathers_per_iteration", "allgather_bytes_per_iteration",
                 "fetch_host_s", "release_host_s", "wait_s", "bubble_s", "gathered_peak_bytes",
                 "shard_bytes", "grad_shard_bytes", "optimizer_state_bytes",
                 "grad_full_peak_bytes", "num_reduce_scatters_per_iteration")


def point_key(overrides) -> str:
    """The identity of a point: its overrides, sorted, space-separated (as typed)."""
    return " ".join(sorted(str(o) for o in overrides))


def parse_value(text: str):
    """An override's value as the table keeps it: bool, int, float, None or the text (Hydra's
    grammar: ``null`` is None; ``none`` is a word, e.g. the ``zero3=none`` group choice)."""
    lowered = text.strip().lower()
    if lowered in ("null", "~"):
        return None
    if lowered in ("true", "false"):
        return lowered == "true"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def override_columns(overrides) -> dict:
    """``{key: value}`` of ``key=value`` overrides (group choices included, e.g. ``replay``)."""
    columns = {}
    for item in overrides:
        key, sep, value = str(item).partition("=")
        if sep:
            columns[key.lstrip("+~")] = parse_value(value)
    return columns


def summary_columns(summary: dict) -> dict:
    """The metric columns of a row from a run summary (see SUMMARY_COLUMNS, ``zero3_*``)."""
    row = {key: summary.get(key) for key in SUMMARY_COLUMNS}
    zero3 = summary.get("zero3") or {}
    row.update({f"zero3_{key}": zero3.get(key) for key in ZERO3_COLUMNS if zero3})
    total = (summary.get("timings_s") or {}).get("total_s")
    row["run_s"] = total
    return row


def make_row(kind: RowKind, key: str, overrides, status: RunStatus, reason: str | None,
             run_dir: str | None, metrics: dict | None = None, **extra) -> dict:
    """One row: identity (``kind``, ``point``, overrides as columns), ``status``, ``reason``,
    where its run dir is (relative to the root), the metrics and any ``extra`` columns."""
    if reason and len(reason) > MAX_REASON_CHARS:
        reason = reason[: MAX_REASON_CHARS - 3] + "..."
    return {KIND: RowKind(kind).value, POINT: key, **override_columns(overrides),
            STATUS: RunStatus(status).value, REASON: reason, RUN_DIR: run_dir,
            **(metrics or {}), **extra, "finished_at": time.time()}


class ResultsStore:
    """The rows and tables under ``root`` (see the module docstring)."""

    def __init__(self, root):
        self.root = Path(root)
        self.rows_dir = self.root / ROWS_DIR

    def _row_path(self, key: str) -> Path:
        return self.rows_dir / (hashlib.sha1(key.encode()).hexdigest()[:16] + ".json")

    def get(self, key: str) -> dict | None:
        """The recorded row of point ``key``, or None (also for a row file that is cut or
        corrupt: said in a warning, and the point runs again)."""
        path = self._row_path(key)
        if not path.is_file():
            return None
        row = self._read_row(path)
        return row if row is not None and row.get(POINT) == key else None  # a clash: no hit

    @staticmethod
    def _read_row(path: Path) -> dict | None:
        """The row in ``path``; None, with a warning naming the file, when it is unreadable."""
        try:
            row = read_json(path, "a results row")
            if not isinstance(row, dict):
                raise ResultsError(f"{path}: a results row is a JSON object; this file holds a "
                                   f"{type(row).__name__}")
        except ResultsError as exc:
            log.warning("skipped %s (its point counts as not run)", exc)
            return None
        return row

    def put(self, row: dict) -> None:
        """Record ``row`` (replacing the point's previous one) and rebuild the tables."""
        self.rows_dir.mkdir(parents=True, exist_ok=True)
        atomic_write(self._row_path(row[POINT]),
                     orjson.dumps(row, default=str, option=orjson.OPT_SERIALIZE_NUMPY))
        self.write_tables()

    def rows(self) -> list[dict]:
        """Every recorded row, in the order the points finished."""
        if not self.rows_dir.is_dir():
            return []
        rows = [row for row in map(self._read_row, self.rows_dir.glob("*.json"))
                if row is not None]
        return sorted(rows, key=lambda r: r.get("finished_at") or 0)

    def frame(self) -> pd.DataFrame:
        """The table as a DataFrame with nullable dtypes (a column mixing types is text)."""
        import pandas as pd  # here: the driver's config imports this module (0.4 s of pandas)

        return tidy_frame(pd.DataFrame(self.rows()))

    def write_tables(self) -> None:
        """Rewrite results.csv and results.parquet from the row files (tmp + rename), under
        the lock; temp files a killed writer left are removed first."""
        with self._lock():
            _remove_stale_temps(self.root, self.rows_dir)
            frame = self.frame()
            for name, write in ((RESULTS_CSV, lambda p: frame.to_csv(p, index=False)),
                                (RESULTS_PARQUET, lambda p: frame.to_parquet(p, index=False))):
                tmp = self.root / f".{name}.{os.getpid()}.tmp"
                write(tmp)
                os.replace(tmp, self.root / name)

    @contextmanager
    def _lock(self):
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / _LOCK_NAME, "a") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)


def tidy_frame(frame: pd.DataFrame) -> pd.DataFrame:
    """Nullable dtypes per column; a column mixing numbers and text becomes text (parquet
    needs one type per column, e.g. a capacity swept as ``64MiB`` and ``1e9``)."""
    import pandas as pd

    frame = frame.convert_dtypes()
    for name in frame.columns:
        if frame[name].dtype == object:
            frame[name] = frame[name].map(lambda v: None if v is None or v is pd.NA else str(v)) \
                .astype("string")
    return frame


def read_json(path, what: str):
    """The JSON value in ``path`` (``what``: the kind of file, for the message); ResultsError
    naming the file when it cannot be read or is not JSON (cut while being written)."""
    try:
        data = Path(path).read_bytes()
        return orjson.loads(data)
    except OSError as e:
        raise ResultsError(f"{path}: cannot read {what} ({e.strerror or e})") from None
    except orjson.JSONDecodeError as e:
        cut = "cut short" if e.pos >= len(data.rstrip()) else "corrupt"
        raise ResultsError(f"{path}: {what} that is not valid JSON ({cut}: {e})") from None


def _remove_stale_temps(root: Path, rows_dir: Path) -> None:
    """Delete the temp files of writers that died before their rename. Called under the
    lock: a table's temp file then belongs to no live writer; a row's (written without the
    lock) only when its pid is gone."""
    for name in (RESULTS_CSV, RESULTS_PARQUET):
        for tmp in root.glob(f".{name}.*.tmp"):
            tmp.unlink(missing_ok=True)
    for tmp in rows_dir.glob(".*.json.*.tmp") if rows_dir.is_dir() else ():
        pid = tmp.name.rsplit(".", 2)[-2]
        if pid.isdigit() and not psutil.pid_exists(int(pid)):
            tmp.unlink(missing_ok=True)
