"""One self-contained HTML page for a run dir or a sweep/search root: PNG plots (written under
``report/`` and embedded as data URIs) and the tables. No script, no font, no link leaves the
file: it opens offline and can be mailed as it is.

A dir with a results table (a sweep root, a minimum-memory search) gets the table, the
threshold curves, the status (OOM) map, the searches, the ZeRO-3 costs and each point's memory
timeline; a run dir (``summary.json``) gets its figures, the per-rank table, the memory
timeline and the iteration times.
"""
from __future__ import annotations

import html
import logging
import re
from pathlib import Path

import pandas as pd
from omegaconf import OmegaConf

from actors.errors import ConfigError
from orchestrator.reports import plots
from orchestrator.reports.oom_study_table import plot_oom_study, study_table
from orchestrator.errors import ResultsError
from orchestrator.results import CAPACITY, KIND, MAX_FAILING_CAPACITY, MIN_CAPACITY, MODE, POINT, \
    REASON, RUN_DIR, STATUS, THRESHOLD, ResultsStore, RowKind
from actors.atomic_file import atomic_write
from orchestrator.units import human_bytes
from orchestrator.outputs import CONFIG_YAML, OOM_STUDY_PNG, REPORT_HTML, REPORT_PLOTS_DIR, \
    RunDir
from orchestrator.reports.html_parts import img, kv_table
from orchestrator.reports.summary_file import read_summary

log = logging.getLogger("tracefleet")

MAX_POINT_TIMELINES = 12  # a sweep page shows this many points' memory timelines
MAX_REASON_CHARS = 120  # a table cell shows this much of a point's reason
_OVERRIDE_KEY = re.compile(r"(?:^| )[+~]?([\w./@-]+)=")  # the keys in a row's ``point``
_RUN_FIGURES = (  # (summary key, label, formatter)
    ("status", "status", str), ("world_size", "ranks", str), ("mode", "replay mode", str),
    ("allocation_mode", "allocation mode", str),
    ("iteration_time_s", "iteration time, slowest rank", lambda v: f"{v * 1e3:.2f} ms"),
    ("iteration_time_ci_low_s", "its 95% interval, low", lambda v: f"{v * 1e3:.2f} ms"),
    ("iteration_time_ci_high_s", "its 95% interval, high", lambda v: f"{v * 1e3:.2f} ms"),
    ("num_timed_iterations", "timed iterations", str),
    ("iteration_time_median_s", "iteration time, median rank", lambda v: f"{v * 1e3:.2f} ms"),
    ("measured_peak_bytes", "peak memory, measured", human_bytes),
    ("accounted_peak_bytes", "peak memory, accounted", human_bytes),
    ("predicted_reserved_peak_bytes", "reserved memory, predicted for the target", human_bytes),
    ("predicted_allocated_peak_bytes", "allocated memory, predicted for the target", human_bytes),
    ("num_alloc_retries", "allocator retries, predicted", str),
    ("liveness_lower_bound_bytes", "liveness lower bound", human_bytes),
    ("device_memory_capacity_bytes", "device capacity", human_bytes),
    ("device_memory_threshold", "flush threshold", lambda v: f"{v:g}"),
    ("num_flushes", "flushes", str), ("flushed_bytes", "flushed", human_bytes),
    ("coverage", "coverage", lambda v: f"{v * 100:.1f}%"), ("error", "error", str))
_RANK_COLUMNS = ("rank", "node_ip", "status", "iteration_time_s", "measured_peak_bytes",
                 "accounted_peak_bytes", "peak_memory_bytes", "liveness_lower_bound_bytes",
                 "num_flushes", "coverage", "error")
_TABLE_METRICS = ("iteration_time_s", "iteration_time_ci_low_s", "iteration_time_ci_high_s",
                  "iteration_time_median_s", "measured_peak_bytes", "accounted_peak_bytes",
                  "predicted_reserved_peak_bytes", "peak_memory_bytes", "liveness_lower_bound_bytes",
                  "num_flushes", "coverage", MIN_CAPACITY, MAX_FAILING_CAPACITY,
                  "num_steps", "zero3_num_allgathers_per_iteration", "zero3_fetch_host_s",
                  "zero3_release_host_s")
_CSS = """body{font-family:sans-serif;margin:24px;color:#222;max-width:1200px}
table{border-collapse:collapse;font-size:13px;margin:8px 0 20px;display:block;overflow-x:auto;
max-width:100%}
th,td{border:1px solid #ccc;padding:3px 8px;text-align:right}th{background:#f3f3f3}
td:first-child,th:first-child{text-align:left}img{max-width:100%;border:1px solid #ddd;margin:6px 0}
.ok{color:#2ca02c}.oom{color:#c51b7d}.failed,.invalid{color:#d62728}
.timeout,.interrupted{color:#ff9f0e}"""


def write_report(directory) -> Path:
    """Write ``report.html`` (and ``report/*.png``) into ``directory``; returns the page's path.

    ConfigError when the dir has neither a results table nor a ``summary.json``.
    """
    root = Path(directory)
    if not root.is_dir():
        raise ConfigError(f"{root}: not a directory (expected a tracefleet run or sweep dir)")
    rows = ResultsStore(root).frame()
    if not rows.empty:
        title, body = f"tracefleet results: {root.resolve().name}", _table_report(root, rows)
    elif RunDir(root).summary.is_file():
        title, body = f"tracefleet run: {root.resolve().name}", _run_report(root)
    else:
        raise ConfigError(f"{root}: no results table (rows/*.json) and no summary.json; expected "
                          f"a tracefleet run dir, sweep root or min_memory run dir")
    page = root / REPORT_HTML
    # whole or not at all: a full disk leaves no half page
    atomic_write(page, (f"<!DOCTYPE html>\n<html><head><meta charset='utf-8'><title>"
                        f"{html.escape(title)}</title><style>{_CSS}</style></head><body><h1>"
                        f"{html.escape(title)}</h1>\n{body}\n</body></html>\n").encode())
    return page


def load_run(run_dir: Path) -> tuple[dict, list[dict]]:
    """A run dir's summary and its rank reports, each with its memory timeline (from the
    summary, else from ``memory/rank-<r>.csv``); the flush threshold from ``config.yaml``
    when the summary lacks it."""
    summary = read_summary(run_dir).to_dict()  # the page reads its figures by name
    config = run_dir / CONFIG_YAML
    if summary.get("device_memory_threshold") is None and config.is_file():
        alloc = OmegaConf.load(config).get("replay", {}).get("allocation", {})
        summary["device_memory_threshold"] = alloc.get("device_memory_threshold")
    ranks = []
    for rank in summary.get("ranks") or []:
        rank = dict(rank)
        csv = run_dir / "memory" / f"rank-{rank.get('rank')}.csv"
        if not rank.get("memory_timeline") and csv.is_file():
            timeline = pd.read_csv(csv)
            columns = [c for c in ("op_index", "bytes", "max_bytes", "min_bytes")
                       if c in timeline]  # runs before the extremes have two columns
            rank["memory_timeline"] = list(zip(*(timeline[c].tolist() for c in columns)))
        ranks.append(rank)
    return summary, ranks


def _run_report(run_dir: Path) -> str:
    summary, ranks = load_run(run_dir)
    out = _plots_dir(run_dir)
    why_not = plots.not_a_bound(summary)
    figures = [(f"{label} (not a bound here: {why_not})" if why_not and
                key == "liveness_lower_bound_bytes" else label, fmt(summary[key]))
               for key, label, fmt in _RUN_FIGURES if summary.get(key) is not None]
    parts = ["<h2>Summary</h2>", kv_table(figures)]
    if summary.get("zero3"):
        parts += ["<h3>ZeRO-3</h3>", kv_table(sorted(
            (k, str(v)) for k, v in summary["zero3"].items() if not isinstance(v, (list, dict))))]
    for name, plot in (("memory_timeline", plots.plot_memory_timeline),
                       ("iteration_times", plots.plot_iteration_times)):
        if plot(summary, ranks, out / f"{name}.png"):
            parts.append(img(out / f"{name}.png", name.replace("_", " ")))
    frame = pd.DataFrame([{k: r.get(k) for k in _RANK_COLUMNS} for r in ranks])
    parts += ["<h2>Ranks</h2>", _frame_html(frame)]
    return "\n".join(parts)


def _table_report(root: Path, rows: pd.DataFrame) -> str:
    out = _plots_dir(root)
    points = rows[rows[KIND] == RowKind.point] if KIND in rows else rows
    counts = rows[STATUS].value_counts().to_dict()
    parts = ["<h2>Results</h2>", "<p>" + ", ".join(
        f"<span class='{html.escape(s)}'>{n} {html.escape(s)}</span>" for s, n in counts.items())
        + f" &mdash; {len(rows)} rows in results.csv / results.parquet</p>"]
    x_key, y_key = map_axes(points)
    drawn = [("threshold_sweep", lambda p: plots.plot_threshold_sweep(points, p),
              "peak memory and iteration time against the threshold"),
             ("status_map", lambda p: x_key is not None and plots.plot_status_map(points, x_key, y_key, p),
              "status of every point (OOM map)"),
             (RowKind.min_memory.value, lambda p: plots.plot_min_memory(rows, p),
              "minimum-memory search"),
             ("zero3", lambda p: plots.plot_zero3(points, p), "ZeRO-3 all-gathers and host time")]
    for name, draw, alt in drawn:
        if draw(out / f"{name}.png"):
            parts.append(img(out / f"{name}.png", alt))
    if KIND in rows and rows[KIND].isin([RowKind.study, RowKind.estimate]).any():
        parts += _oom_study(root, rows, out)
    answers = rows[rows[KIND] == RowKind.min_memory] if KIND in rows else rows.iloc[0:0]
    if not answers.empty:
        parts += ["<h2>Minimum memory</h2>", _frame_html(_display(answers, [
            *override_keys(answers), MIN_CAPACITY, MAX_FAILING_CAPACITY,
            "tolerance_bytes", "num_steps", "search_s"]))]
    if not points.empty:
        keys = override_keys(points)
        swept = [k for k in keys if points[k].nunique(dropna=False) > 1]
        fixed = ", ".join(f"{k}={points[k].iloc[0]}" for k in keys if k not in swept)
        parts += ["<h2>Points</h2>", f"<p>every point: {html.escape(fixed)}</p>" if fixed else "",
                  _frame_html(_display(points, swept))]
        parts += _point_timelines(root, points, swept, out)
    return "\n".join(parts)


def _oom_study(root: Path, rows: pd.DataFrame, out: Path) -> list[str]:
    """experiment=oom_study: its table, its plot and the memory timeline of each replay."""
    table = pd.DataFrame(study_table(rows.to_dict("records")))
    parts = ["<h2>OOM study</h2>", _frame_html(table)]
    if plot_oom_study(rows, out / OOM_STUDY_PNG):
        parts.append(img(out / OOM_STUDY_PNG, "minimum capacity per mode and estimate"))
    studied = rows[rows[KIND] == RowKind.study]
    keys = [MODE, THRESHOLD, CAPACITY]
    return parts + _point_timelines(root, studied, [k for k in keys if k in studied], out)


def override_keys(rows: pd.DataFrame) -> list[str]:
    """The override keys of the rows (from each row's ``point``), in first-seen order."""
    keys = {}
    for point in rows.get(POINT, pd.Series(dtype=str)).dropna():
        for key in _OVERRIDE_KEY.findall(str(point)):
            keys[key] = None
    return [k for k in keys if k in rows]


def map_axes(points: pd.DataFrame) -> tuple[str | None, str | None]:
    """The two axes of the status map: the capacity (when swept) across, the allocation mode
    (when swept) down, else the swept keys in order (one axis when a single key is swept)."""
    swept = [k for k in override_keys(points) if points[k].nunique(dropna=False) > 1]
    swept.sort(key=lambda k: (k != CAPACITY, k != MODE))
    if CAPACITY not in swept and MODE in swept and len(swept) > 1:
        swept[0], swept[1] = swept[1], swept[0]  # the mode goes down, another key across
    return (swept + [None, None])[0], (swept + [None, None])[1]


def _point_timelines(root: Path, points: pd.DataFrame, swept: list[str], out: Path) -> list[str]:
    parts = []
    for _, row in points.head(MAX_POINT_TIMELINES).iterrows():
        run_dir = root / str(row.get(RUN_DIR) or "")
        if pd.isna(row.get(RUN_DIR)) or not RunDir(run_dir).summary.is_file():
            continue
        try:
            summary, ranks = load_run(run_dir)
        except ResultsError as exc:  # one point's file: the rest of the page still stands
            log.warning("no memory timeline for %s: %s", row[RUN_DIR], exc)
            continue
        path = out / f"timeline_{str(row['run_dir']).replace('/', '_')}.png"
        if plots.plot_memory_timeline(summary, ranks, path):
            label = ", ".join(f"{k}={row[k]}" for k in swept) or str(row[RUN_DIR])
            parts += [f"<h3>{html.escape(label)}</h3>", img(path, f"memory timeline {label}")]
    return (["<h2>Memory timelines</h2>"] + parts) if parts else []


def _display(rows: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """``keys`` then status, reason and the metrics a reader compares, bytes and seconds in
    readable units."""
    cols = [*keys, STATUS, REASON,
            *(c for c in _TABLE_METRICS if c in rows and rows[c].notna().any())]
    shown = rows[[c for c in dict.fromkeys(cols) if c in rows]].copy()
    for col in shown.columns:
        if col == "reason":  # the full text is in results.csv
            shown[col] = shown[col].map(lambda v: v if pd.isna(v) or len(v) <= MAX_REASON_CHARS
                                        else v[:MAX_REASON_CHARS - 3] + "...")
        elif col.endswith("_bytes"):
            shown[col] = shown[col].map(lambda v: human_bytes(v) if pd.notna(v) else "-")
        elif col.endswith("_s"):
            shown[col] = shown[col].map(lambda v: f"{v * 1e3:.2f} ms" if pd.notna(v) else "-")
    return shown.astype(object).where(shown.notna(), "-")


def _frame_html(frame: pd.DataFrame) -> str:
    return frame.to_html(index=False, escape=True, na_rep="-", border=0)




def _plots_dir(root: Path) -> Path:
    out = root / REPORT_PLOTS_DIR
    out.mkdir(exist_ok=True)
    return out
