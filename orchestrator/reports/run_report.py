"""Present a run summary: the console tables, the files of a run directory and its plots.

Files written by ``write_run_outputs`` (paths relative to the run directory):
``summary.json``, ``ranks.csv``, ``ranks.parquet``, ``config.yaml`` (when given),
``memory/rank-<r>.csv`` (``op_index,bytes,max_bytes,min_bytes``: bytes held after the op, the
most and fewest held since the previous row), ``memory_timeline.png``, ``iteration_times.png``.

The rank table has one row of flat scalar columns per rank: scalars are kept as they are,
``collectives`` becomes ``coll_<kind>_<field>`` columns, ``oom`` becomes ``oom_<field>``,
``memory_measure`` becomes ``measure_<field>``, ``iteration_times_s`` also yields
``num_iterations``, and any other list or dict is kept as a JSON string in ``<key>_json``.
"""
from __future__ import annotations

import numbers
import re
import sys
from pathlib import Path

import numpy as np
import orjson
import pandas as pd
from rich import box
from rich.console import Console
from rich.table import Table

from actors.errors import writing
from actors.hardlink import link_or_copy
from orchestrator.reports.plots import not_a_bound, plot_iteration_times, plot_memory_timeline, \
    timeline_points
from orchestrator.reports.plots import timeline_scale  # noqa: F401 (re-exported)
from orchestrator.reports.not_run import not_run_lines
from actors.atomic_file import atomic_write, write_with
from orchestrator.outputs import CONFIG_YAML, ITERATION_TIMES_PNG, MEMORY_DIR, \
    MEMORY_TIMELINE_PNG, RANKS_CSV, RANKS_PARQUET, REPORT_HTML, RunDir
from orchestrator.status import RunStatus
from orchestrator.units import human_bytes

_MiB = 1 << 20
_STATUS_STYLE = {RunStatus.ok: "green", RunStatus.oom: "magenta", RunStatus.timeout: "yellow",
                 RunStatus.failed: "red"}


def _column_key(name) -> str:
    """Column-safe form of a collective kind or field name: ``[a-z0-9_]`` only."""
    return re.sub(r"[^a-z0-9]+", "_", str(name).lower()).strip("_")


def _json_str(value) -> str:
    return orjson.dumps(value, default=str).decode()


def flatten_rank(rank: dict) -> dict:
    """One rank's summary row as flat scalar columns (see the module docstring)."""
    row: dict = {}
    for key, value in rank.items():
        if key == "collectives":
            for kind, stats in (value or {}).items():
                for field, stat in stats.items():
                    row[f"coll_{_column_key(kind)}_{_column_key(field)}"] = stat
        elif key == "oom":
            for field, stat in (value or {}).items():
                row[f"oom_{_column_key(field)}"] = stat
        elif key == "memory_measure":
            for field, stat in (value or {}).items():
                if not isinstance(stat, (list, dict)):
                    row[f"measure_{_column_key(field)}"] = stat
        elif key == "iteration_times_s":
            row["num_iterations"] = len(value or [])
            row["iteration_times_s_json"] = _json_str(value)
        elif isinstance(value, (dict, list, tuple)):
            row[f"{key}_json"] = _json_str(value)
        else:
            row[key] = value
    return row


def _column_dtype(values: list) -> str:
    """Nullable dtype from the Python types present, so a rank missing a value keeps ints int
    and a float column stays float even when every value happens to be integral."""
    present = [v for v in values if v is not None and not pd.isna(v)]
    if not present:  # nothing reported (e.g. "error" on a clean run): text is the least surprising
        return "string"
    # isinstance, not type(): reports may carry numpy scalars; bool is an Integral, test it first.
    if all(isinstance(v, (bool, np.bool_)) for v in present):
        return "boolean"
    if all(isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in present):
        return "Int64"
    if all(isinstance(v, numbers.Real) and not isinstance(v, bool) for v in present):
        return "Float64"
    return "string"


def ranks_frame(summary: dict) -> pd.DataFrame:
    """The per-rank table of a summary: one row per rank, flat nullable-typed columns."""
    rows = [flatten_rank(r) for r in summary.get("ranks", [])]
    columns = list(dict.fromkeys(key for row in rows for key in row))
    return pd.DataFrame({
        name: pd.Series([row.get(name) for row in rows], dtype=object).astype(
            _column_dtype([row.get(name) for row in rows]))
        for name in columns
    })


def _write_memory_timelines(rank_reports: list[dict], memory_dir: Path) -> list[Path]:
    paths = []
    written: dict[int, Path] = {}  # id(timeline) -> its file: ranks replayed once share one
    for report in rank_reports:
        timeline = report.get("memory_timeline")
        if not timeline:
            continue
        memory_dir.mkdir(parents=True, exist_ok=True)
        path = memory_dir / f"rank-{report['rank']}.csv"
        if id(timeline) in written:
            link_or_copy(str(written[id(timeline)]), str(path))
        else:
            lines = "".join(f"{op},{held},{most},{fewest}\n"
                            for op, held, most, fewest in timeline_points(timeline))
            atomic_write(path, ("op_index,bytes,max_bytes,min_bytes\n" + lines).encode())
            written[id(timeline)] = path
        paths.append(path)
    return paths


def _replayed(rank_reports: list[dict]) -> list[dict]:
    """The reports of the ranks that replayed (a rank replayed as another is a copy of it)."""
    return [r for r in rank_reports if r.get("replayed_as_rank", r.get("rank")) == r.get("rank")]


def write_summary(summary: dict, out_dir: Path) -> Path:
    """Write (or rewrite) ``summary.json`` in ``out_dir``, whole or not at all (a run killed
    meanwhile leaves the previous one); returns its path."""
    path = RunDir(out_dir).summary
    atomic_write(path, orjson.dumps(summary, default=str,
                                    option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY))
    return path


def write_run_outputs(summary: dict, rank_reports: list[dict], out_dir: Path,
                      config_yaml: str | None, plots: bool = True) -> dict[str, Path]:
    """Write every file of a run directory (see the module docstring); returns name -> path.

    ``rank_reports`` are the raw reports (with ``memory_timeline``); ``summary`` comes from
    ``orchestrator.run.aggregate.aggregate``. Plots without data are skipped, all of them with
    ``plots=False``; they draw the ranks that replayed (not the copies of a deduplicated run:
    orchestrator/preflight/dedup.py), and copies' memory timelines are hard links of their original's.
    """
    out_dir = Path(out_dir)
    with writing(out_dir, "the run's outputs"):  # a full disk: the folder is named
        return _write_run_outputs(summary, rank_reports, out_dir, config_yaml, plots)


def _write_run_outputs(summary: dict, rank_reports: list[dict], out_dir: Path,
                       config_yaml: str | None, plots: bool) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    written: dict[str, Path] = {}

    written["summary"] = write_summary(summary, out_dir)

    frame = ranks_frame(summary)
    written["ranks_csv"] = out_dir / RANKS_CSV
    write_with(written["ranks_csv"], lambda buffer: frame.to_csv(buffer, index=False))
    written["ranks_parquet"] = out_dir / RANKS_PARQUET
    write_with(written["ranks_parquet"], lambda buffer: frame.to_parquet(buffer, index=False))

    if config_yaml is not None:
        written["config"] = out_dir / CONFIG_YAML
        atomic_write(written["config"], config_yaml.encode())

    for path in _write_memory_timelines(rank_reports, out_dir / MEMORY_DIR):
        written[f"memory_{path.stem}"] = path

    for name, file, plot in (("memory_timeline", MEMORY_TIMELINE_PNG, plot_memory_timeline),
                             ("iteration_times", ITERATION_TIMES_PNG, plot_iteration_times)) \
            if plots else ():
        path = out_dir / file
        if plot(summary, _replayed(rank_reports), path):
            written[f"{name}_plot"] = path
    return written


def _short(value: float) -> str:
    """Short fixed-point text without exponents: 1.23, 12.3, 123.4, 1235."""
    digits = 2 if abs(value) < 10 else 1 if abs(value) < 1000 else 0
    return f"{value:.{digits}f}"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else _short(seconds * 1e3)


def _mib(num_bytes: int | None) -> str:
    return "-" if num_bytes is None else _short(num_bytes / _MiB)


def _status(status: str | None) -> str:
    style = _STATUS_STYLE.get(status, "red")
    return f"[{style}]{status}[/{style}]"


def _ranks_table(summary: dict) -> Table:
    table = Table(title=f"tracefleet run: {summary.get('world_size')} ranks{_how(summary)}",
                  title_justify="left",
                  box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    # Two-line headers and a wrapable node column keep 10 columns readable in 80 characters.
    table.add_column("rank", justify="right", no_wrap=True)
    table.add_column("node", overflow="fold")
    table.add_column("status", no_wrap=True)
    # reserved*: the allocator model's prediction for target, beside the accounted peak
    predicted = summary.get("predicted_reserved_peak_bytes") is not None
    for header in ("iter\nms", "comp\nms", "comm\nms", "measured\nMiB", "accounted\nMiB",
                   *(("reserved*\nMiB",) if predicted else ()), "bound\nMiB", "flush", "cov\n%"):
        table.add_column(header, justify="right", no_wrap=True)
    for r in summary.get("ranks", []):
        coverage = r.get("coverage")
        reserved = (_mib(r.get("predicted_reserved_peak_bytes")),) if predicted else ()
        table.add_row(
            str(r.get("rank")), r.get("node_ip") or "-", _status(r.get("status")),
            _ms(r.get("iteration_time_s")), _ms(r.get("compute_time_s")), _ms(r.get("comm_time_s")),
            _mib(r.get("measured_peak_bytes")), _mib(r.get("accounted_peak_bytes")),
            *reserved, _mib(r.get("liveness_lower_bound_bytes")),
            "-" if r.get("num_flushes") is None else str(r["num_flushes"]),
            "-" if coverage is None else f"{coverage * 100:.1f}",
        )
    return table


def _collectives_table(collectives: dict) -> Table:
    table = Table(title="collectives (calls and bytes summed over ranks, times median)",
                  title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for header in ("kind", "ranks", "calls", "bytes", "time ms", "algbw GB/s", "busbw GB/s"):
        table.add_column(header, justify="left" if header == "kind" else "right", no_wrap=True)
    for kind, c in collectives.items():
        table.add_row(kind, str(c.get("num_ranks", "-")), str(c.get("num_calls", "-")),
                      human_bytes(c.get("bytes")), _ms(c.get("time_s")),
                      *("-" if c.get(k) is None else f"{c[k]:.2f}" for k in ("algbw_gbps", "busbw_gbps")))
    return table


MIN_ITERATIONS_TO_COMPARE = 6  # as the headline's 95% interval (actors/replay/timed_iterations.py)


def _how(summary: dict) -> str:
    """How the ranks replayed (mode, device, allocation): a dry run's lazy allocation and
    unmeasured meta device change what the figures mean, so the title says so."""
    devices = sorted({str(r["device"]) for r in summary.get("ranks", []) if r.get("device")})
    parts = [f"{summary['mode']} replay" if summary.get("mode") else None,
             f"on {'/'.join(devices)}" if devices else None,
             f"{summary['allocation_mode']} allocation" if summary.get("allocation_mode") else None]
    return "".join(f", {p}" for p in parts if p)


def interval_text(summary: dict) -> str:
    """``95% CI 54.1-58.3 ms over 20 iters`` (or why there is none) for the headline time."""
    n = summary.get("num_timed_iterations")
    low, high = summary.get("iteration_time_ci_low_s"), summary.get("iteration_time_ci_high_s")
    if low is None or high is None:
        return f"no 95% CI: {n or 0} iters, 6 needed"
    return f"95% CI {_ms(low)}-{_ms(high)} ms over {n} iters"


def _footer(summary: dict) -> str:
    """Two lines: status and time (with the headline's interval), then memory and coverage."""
    stats = summary.get("iteration_time_stats_s") or {}
    # the step ends when its slowest rank does: per iteration the slowest rank's time, then
    # the median over iterations, which is above every rank's own median when ranks take
    # turns being slowest
    parts = [f"status {_status(summary.get('status'))}",
             f"iter {_ms(summary.get('iteration_time_s'))} ms (slowest rank per iteration; "
             f"{interval_text(summary)}; rank medians {_ms(stats.get('min'))}-"
             f"{_ms(stats.get('max'))} ms)"]
    num_timed = summary.get("num_timed_iterations") or 0
    if summary.get("straggler_rank") is not None and summary.get("skew") is not None:
        if num_timed >= MIN_ITERATIONS_TO_COMPARE and summary.get("straggler_distinct"):
            # its median's 95% interval lies above the fastest rank's (run/aggregate.py)
            parts.append(f"straggler rank {summary['straggler_rank']} (skew "
                         f"{summary['skew']:.2f}x, beyond noise)")
        elif num_timed >= MIN_ITERATIONS_TO_COMPARE:
            parts.append(f"no straggler (rank {summary['straggler_rank']} slowest, skew "
                         f"{summary['skew']:.2f}x within noise)")
        else:  # one iteration's noise is no straggler
            parts.append(f"ranks not compared ({num_timed} timed iteration(s), "
                         f"{MIN_ITERATIONS_TO_COMPARE} needed)")
    measured = summary.get("measured_peak_bytes")
    why_not = not_a_bound(summary)
    more = [(f"peak {human_bytes(measured)} measured, " if measured is not None else "")
            + f"{human_bytes(summary.get('accounted_peak_bytes'))} accounted, "
            + (f"liveness {human_bytes(summary.get('liveness_lower_bound_bytes'))} (not a "
               f"bound: {why_not})" if why_not else
               f"bound {human_bytes(summary.get('liveness_lower_bound_bytes'))}")]
    if summary.get("predicted_reserved_peak_bytes") is not None:
        more.append(_target_part(summary))
    if summary.get("coverage") is not None:
        more.append(f"coverage {summary['coverage'] * 100:.1f}% (min over ranks)")
    return " | ".join(parts) + "\n" + " | ".join(more)


MAX_SKIPPED_REASONS = 4  # reasons named on the console (summary.json has them all)


def skipped_line(summary: dict) -> str | None:
    """``not replayed: 2 ops: <reason> (1), <reason> (1)``: the ops left out of the coverage,
    most frequent reason first (None when every op replayed)."""
    reasons = {k: v for k, v in (summary.get("skipped_reasons") or {}).items() if v}
    if not reasons:
        return None
    ranked = sorted(reasons.items(), key=lambda kv: -kv[1])
    shown = "; ".join(f"{reason} ({count})" for reason, count in ranked[:MAX_SKIPPED_REASONS])
    more = f"; {len(ranked) - MAX_SKIPPED_REASONS} more reasons in summary.json" \
        if len(ranked) > MAX_SKIPPED_REASONS else ""
    return f"not replayed (summed over ranks): {sum(reasons.values())} op(s): {shown}{more}"


def breakdown_line(summary: dict) -> str | None:
    """``peak (accounted) at rank r node N op: category size, ...`` (largest first)."""
    parts = summary.get("peak_breakdown")
    if not parts:
        return None
    op = summary.get("peak_op")
    where = (f" at rank {op['rank']} node {op['node_id']} {op['op']}"
             + (" (in a hook next to it)" if op.get("hook") else "")) if op else ""
    items = sorted(((k, v) for k, v in parts.items() if v), key=lambda kv: -kv[1])
    return f"peak (accounted){where}: " + ", ".join(f"{k} {human_bytes(v)}" for k, v in items)


def _target_part(summary: dict) -> str:
    """The allocator model's peaks (reserved*: predicted for the target, not measured) and
    whether the target holds them."""
    ooms = summary.get("num_predicted_ooms")
    verdict = f", [red]does not fit the target: {ooms} OOMs[/red]" if ooms else ""
    return (f"reserved* {human_bytes(summary['predicted_reserved_peak_bytes'])} predicted "
            f"(allocated {human_bytes(summary.get('predicted_allocated_peak_bytes'))}, "
            f"{summary.get('num_alloc_retries') or 0} alloc retries{verdict})")


def _target_line(t: dict) -> str:
    """The target's memory, what no tensor shows, and where each default comes from."""
    d = t.get("defaults") or {}
    return (f"target {t['name']}: {human_bytes(t['device_memory_bytes'])} device "
            f"[{d.get('device_memory')}] - context {human_bytes(t['cuda_context_bytes'])} "
            f"[{d.get('cuda_context')}] - NCCL {human_bytes(t['nccl_buffer_bytes'])} "
            f"[{d.get('nccl')}] = usable {human_bytes(t['usable_capacity_bytes'])}; cuBLAS "
            f"workspace {human_bytes(t['cublas_workspace_bytes'])} [{d.get('cublas_workspace')}]")


def _zero3_line(z: dict) -> str:
    """ZeRO-3 emulation figures per iteration (medians over ranks)."""
    if z.get("num_params") and not z.get("num_partitioned"):
        # DeepSpeed's default threshold (1e5 elements) keeps every parameter of a small model
        return (f"zero3 {z.get('strategy')}: none of the {z['num_params']} parameters is "
                "partitioned: all are under zero3.param_persistence_threshold (set it to 0 "
                "to partition them all)")
    line = (f"zero3 {z.get('strategy')} (world {z.get('world_size')}) | "
            f"{z.get('num_allgathers_per_iteration')} all-gathers/iter, "
            f"{human_bytes(z.get('allgather_bytes_per_iteration'))} | host fetch "
            f"{_ms(z.get('fetch_host_s'))} ms + release {_ms(z.get('release_host_s'))} ms, "
            f"wait {_ms(z.get('wait_s'))} ms, bubble {_ms(z.get('bubble_s'))} ms | gathered peak "
            f"{human_bytes(z.get('gathered_peak_bytes'))}, shard {human_bytes(z.get('shard_bytes'))}")
    if z.get("optimizer_state_bytes") is not None:  # the other model states, also 1/N
        line += (f", grad shards {human_bytes(z.get('grad_shard_bytes'))}, optimizer state "
                 f"{human_bytes(z.get('optimizer_state_bytes'))}")
    return line


def print_outputs(out_dir: Path, console=None) -> None:
    """The run's folder and what is in it, and its page (or the command that writes it)."""
    console = console or Console()
    out_dir = Path(out_dir).resolve()
    names = [p.name + ("/" if p.is_dir() else "") for p in sorted(out_dir.iterdir())
             if not p.name.startswith(".")]
    console.print(f"results: {out_dir} ({', '.join(names)})", markup=False)
    page = out_dir / REPORT_HTML
    console.print(f"page: {page}" if page.is_file() else
                  f"page: tracefleet-report {out_dir}  (writes report.html there)", markup=False)


def print_summary(summary: dict, console: Console | None = None) -> None:
    """Print the per-rank table, the collectives table (if any), a one-line footer, the
    accounted peak's breakdown and the ZeRO-3 line (when emulating)."""
    # Logs and CI capture are not terminals: rich would fold the tables to 80 columns.
    console = console or Console(width=None if sys.stdout.isatty() else 132)
    console.print(_ranks_table(summary))
    if summary.get("collectives"):
        console.print(_collectives_table(summary["collectives"]))
    console.print(_footer(summary))
    line = breakdown_line(summary)
    if line:
        console.print(line, markup=False)
    # not_run_ops names each op with its bytes; older summaries have the reasons only
    line = None if summary.get("not_run_ops") else skipped_line(summary)
    if line:
        console.print("warning: " + line, style="yellow", markup=False)
    for warning in summary.get("machine_warnings") or ():
        console.print("warning: " + warning, style="yellow", markup=False)
    for warning in not_run_lines(summary.get("not_run_ops"), summary.get("not_run_rank")):
        console.print(warning, style="yellow", markup=False)
    if summary.get("zero3"):
        console.print(_zero3_line(summary["zero3"]), markup=False)
    if summary.get("target"):
        console.print(_target_line(summary["target"]), markup=False)
    if summary.get("error"):
        # markup=False: error text may contain brackets that rich would parse as styles.
        console.print("error: " + summary["error"], style="bold red", markup=False)
