"""Every plot tracefleet draws, as PNG files: a run's memory timeline and iteration times, and a
results table's threshold curves, status (OOM) map, minimum-memory searches and ZeRO-3 costs.

Each function returns False (and writes nothing) when its data is absent. Matplotlib's
object API only (no pyplot): no global state, no GUI backend.
"""
from __future__ import annotations

from bisect import bisect_right
from pathlib import Path

import pandas as pd
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure

from actors.atomic_file import write_with
from orchestrator.results import ALLOCATION_MODE, DEVICE_CAPACITY_BYTES, DEVICE_THRESHOLD, KIND, \
    MIN_CAPACITY, MODE, STATUS, THRESHOLD, RowKind
from orchestrator.status import RunStatus
from orchestrator.units import byte_unit, human_bytes
from actors.errors import ConfigError
from actors.replay.config import parse_bytes

MAX_LEGEND_RANKS = 16  # past this a legend hides the plot
STATUS_COLORS = {RunStatus.ok: "#2ca02c", RunStatus.oom: "#c51b7d", RunStatus.failed: "#d62728",
                 RunStatus.timeout: "#ff9f0e", RunStatus.invalid: "#7f7f7f"}
_MISSING_COLOR = "#eeeeee"


def timeline_scale(peak: int, bound: int | None, capacity: int | None) -> tuple[float, str, bool]:
    """(bytes per y unit, unit name, capacity off the scale) for the memory timeline.

    A capacity far above the curves (host RAM on cpu) would flatten them: it is named in the
    title instead of drawn.
    """
    far_capacity = bool(capacity) and capacity > 4 * max(peak, bound or 0)
    drawn = (peak, bound) if far_capacity else (peak, bound, capacity)
    scale, unit = byte_unit(max((v for v in drawn if v), default=0))
    return scale, unit, far_capacity


def timeline_points(timeline) -> list[tuple[int, int, int, int]]:
    """(op index, bytes held after it, most and fewest held since the previous point) of a
    rank's downsampled memory timeline; a point of two values (an older run) is its own
    extremes."""
    return [(int(p[0]), int(p[1]), int(p[2]), int(p[3])) if len(p) >= 4
            else (int(p[0]), int(p[1]), int(p[1]), int(p[1])) for p in timeline]


def _held_at(timeline, tick: int) -> int:
    """Bytes held at op ``tick`` read off a (downsampled) step timeline."""
    i = bisect_right([p[0] for p in timeline], tick) - 1
    return timeline[max(i, 0)][1]


def not_a_bound(summary: dict) -> str | None:
    """Why the liveness lower bound does not bound this run's peak (None when it does): it is
    the peak if every storage lived exactly from its first to its last use, which a replay
    that runs every op and holds what it made until its last use cannot go below. A comms
    replay runs no compute op, and a lazy replay that flushed let go of live storages early."""
    if summary.get("mode") == "comms":
        return "replay.mode=comms runs no compute op"
    if summary.get("allocation_mode") == "lazy" and summary.get("num_flushes"):
        return "the lazy replay flushed live storages"
    return None


def plot_memory_timeline(summary: dict, rank_reports: list[dict], path: Path) -> bool:
    """Bytes held over op index, one line per rank: the most held in each downsampled bucket,
    shaded down to the fewest, so no extreme is lost; the peak marked; flushes marked on each
    rank's line; the liveness bound (where it bounds: ``not_a_bound``), the capacity and the
    flush threshold (threshold x capacity)."""
    ranks = sorted((r for r in rank_reports if r.get("memory_timeline")), key=lambda r: r["rank"])
    if not ranks:
        return False
    # drawn only where it bounds (a line above the peak would read as a broken bound)
    bound = None if not_a_bound(summary) else summary.get("liveness_lower_bound_bytes")
    capacity = summary.get(DEVICE_CAPACITY_BYTES)
    threshold = summary.get(DEVICE_THRESHOLD)
    points = {r["rank"]: timeline_points(r["memory_timeline"]) for r in ranks}
    peak_rank, (peak_op, _, peak, _) = max(
        ((rank, p) for rank, pts in points.items() for p in pts), key=lambda rp: rp[1][2])
    scale, unit, far_capacity = timeline_scale(peak, bound, capacity)
    fig = Figure(figsize=(10, 5), dpi=100)
    ax = fig.add_subplot()
    num_flushes = 0
    marker_size = 5 if sum(len(r.get("flush_ticks") or []) for r in ranks) < 200 else 2
    for r in ranks:
        ops, held, most, fewest = zip(*points[r["rank"]])
        # a point's extremes cover the ops since the previous point: drawn "pre"
        line, = ax.plot(ops, [b / scale for b in most], drawstyle="steps-pre", linewidth=0.8,
                        label=f"rank {r['rank']}")
        if most != fewest:  # a band only where buckets vary (filling costs time)
            ax.fill_between(ops, [b / scale for b in fewest], [b / scale for b in most],
                            step="pre", color=line.get_color(), alpha=0.2, linewidth=0)
        ticks = r.get("flush_ticks") or []
        num_flushes += len(ticks)
        ax.plot(ticks, [_held_at(r["memory_timeline"], t) / scale for t in ticks], "v",
                color=line.get_color(), markersize=marker_size)
    ax.plot([peak_op], [peak / scale], "*", color="black", markersize=11, zorder=5,
            label=f"peak {human_bytes(peak)} (rank {peak_rank}, op {peak_op})")
    if bound:
        ax.axhline(bound / scale, color="black", linestyle="--", linewidth=1,
                   label=f"liveness lower bound ({human_bytes(bound)})")
    if capacity and not far_capacity:
        ax.axhline(capacity / scale, color="red", linestyle=":", linewidth=1.2,
                   label=f"capacity ({human_bytes(capacity)})")
        if threshold is not None and threshold < 1:
            ax.axhline(threshold * capacity / scale, color="darkorange", linestyle="-.",
                       linewidth=1.2, label=f"flush threshold ({threshold:g} x capacity)")
    if num_flushes:
        ax.plot([], [], "v", color="gray", label=f"flush ({num_flushes} over all ranks)")
    ax.set_xlabel("op index")
    ax.set_ylabel(f"bytes held ({unit})")
    title = f"Memory timeline ({len(ranks)} ranks, status {summary.get('status')})"
    if far_capacity:
        title += f"; capacity {human_bytes(capacity)} off the scale"
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if len(ranks) <= MAX_LEGEND_RANKS:  # outside: inside, it would hide the peak
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return _save(fig, path)


def plot_iteration_times(summary: dict, rank_reports: list[dict], path: Path) -> bool:
    """Box plot of each rank's iteration times in ms, a straggler (beyond noise) in red."""
    series = sorted(((r["rank"], r["iteration_times_s"]) for r in rank_reports
                     if r.get("iteration_times_s")), key=lambda t: t[0])
    if not series:
        return False
    ranks = [rank for rank, _ in series]
    fig = Figure(figsize=(max(6, 0.4 * len(ranks) + 2), 4.5), dpi=100)
    ax = fig.add_subplot()
    boxes = ax.boxplot([[t * 1e3 for t in times] for _, times in series], patch_artist=True)
    ax.set_xticks(range(1, len(ranks) + 1), [str(r) for r in ranks])
    slowest, skew = summary.get("straggler_rank"), summary.get("skew")
    distinct = bool(summary.get("straggler_distinct"))  # beyond noise (run/aggregate.py)
    for rank, patch in zip(ranks, boxes["boxes"]):
        patch.set_facecolor("tab:red" if distinct and rank == slowest else "tab:blue")
        patch.set_alpha(0.6)
    title = "Iteration time per rank"
    if slowest is not None and skew is not None:
        title += (f" (straggler rank {slowest}, skew {skew:.2f}x)" if distinct else
                  f" (slowest rank {slowest}, skew {skew:.2f}x: within noise)")
    ax.set_title(title)
    ax.set_xlabel("rank")
    ax.set_ylabel("iteration time (ms)")
    ax.grid(alpha=0.3, axis="y")
    return _save(fig, path)


def plot_threshold_sweep(frame: pd.DataFrame, path: Path) -> bool:
    """Peak memory and iteration time (slowest rank) against the flush threshold, one line per
    allocation mode (and capacity, when it varies); points that did not finish as crosses."""
    need = {DEVICE_THRESHOLD, ALLOCATION_MODE, STATUS}
    if not need <= set(frame.columns) or frame[DEVICE_THRESHOLD].nunique() < 2:
        return False
    frame = frame.sort_values(DEVICE_THRESHOLD)
    by = [ALLOCATION_MODE] + ([DEVICE_CAPACITY_BYTES] if frame.get(
        DEVICE_CAPACITY_BYTES, pd.Series(dtype=float)).nunique() > 1 else [])
    peak_col = "peak_memory_bytes" if "peak_memory_bytes" in frame else None
    scale, unit = byte_unit(frame[peak_col].max() if peak_col else 0)
    fig = Figure(figsize=(11, 4.5), dpi=100)
    ax_mem, ax_time = fig.subplots(1, 2)
    for key, group in frame.groupby(by, dropna=False):
        key = key if isinstance(key, tuple) else (key,)
        label = " ".join([str(key[0])] + [f"cap {human_bytes(k)}" for k in key[1:] if pd.notna(k)])
        ok, bad = group[group[STATUS] == RunStatus.ok], group[group[STATUS] != RunStatus.ok]
        if peak_col:
            line, = ax_mem.plot(ok[DEVICE_THRESHOLD], ok[peak_col] / scale, "o-", label=label)
            ax_mem.plot(bad[DEVICE_THRESHOLD], bad[peak_col].fillna(0) / scale, "x",
                        color=line.get_color(), markersize=9)
        if "iteration_time_s" in group:
            ax_time.plot(ok[DEVICE_THRESHOLD], ok["iteration_time_s"] * 1e3, "o-", label=label)
            low, high = _interval_ms(ok)
            if low is not None:  # each point's 95% interval: load noise is not an effect
                ax_time.errorbar(ok[DEVICE_THRESHOLD], ok["iteration_time_s"] * 1e3,
                                 yerr=[low, high], fmt="none", capsize=3, alpha=0.6,
                                 ecolor=ax_time.lines[-1].get_color())
    if (frame[STATUS] != RunStatus.ok).any():
        ax_mem.plot([], [], "x", color="gray", label="did not finish (peak before it stopped)")
    if {CI_LOW, CI_HIGH} <= set(frame.columns) and frame[CI_LOW].notna().any():
        ax_time.plot([], [], "|", color="gray", markersize=9, label="95% interval")
    for ax, ylabel, title in ((ax_mem, f"peak memory ({unit})", "Peak memory"),
                              (ax_time, "iteration time, slowest rank (ms)", "Iteration time")):
        ax.set_xlabel(f"{DEVICE_THRESHOLD} (fraction of capacity)")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{title} against the flush threshold")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    return _save(fig, path)


CI_LOW, CI_HIGH = "iteration_time_ci_low_s", "iteration_time_ci_high_s"


def _interval_ms(points: pd.DataFrame) -> tuple[list | None, list | None]:
    """Below and above each point's time to its 95% interval's ends, ms (0 where a point has
    none: too few iterations); (None, None) when no point has one."""
    if not {CI_LOW, CI_HIGH} <= set(points.columns) or points[CI_LOW].isna().all():
        return None, None
    t = points["iteration_time_s"]
    low = ((t - points[CI_LOW]).clip(lower=0) * 1e3).fillna(0).tolist()
    high = ((points[CI_HIGH] - t).clip(lower=0) * 1e3).fillna(0).tolist()
    return low, high


def plot_status_map(frame: pd.DataFrame, x_key: str, y_key: str | None, path: Path) -> bool:
    """One cell per (x, y) value pair, colored by the worst status of its points (an OOM map)
    and naming the counts when they differ; ``x_key`` and ``y_key`` are columns, ordered by
    number or size where they parse as one."""
    if x_key not in frame or (y_key is not None and y_key not in frame) or frame.empty:
        return False
    xs = _ordered(frame[x_key])
    ys = _ordered(frame[y_key]) if y_key else [None]
    worst_first = [RunStatus.oom, RunStatus.failed, RunStatus.timeout, RunStatus.invalid,
                   RunStatus.ok]
    cells: dict[tuple[int, int], dict[str, int]] = {}
    for _, row in frame.iterrows():
        cell = (ys.index(_label(row[y_key])) if y_key else 0, xs.index(_label(row[x_key])))
        status = RunStatus(row[STATUS]) if row[STATUS] in STATUS_COLORS else RunStatus.failed
        counts = cells.setdefault(cell, {})
        counts[status] = counts.get(status, 0) + 1
    grid = [[0] * len(xs) for _ in ys]  # 0: no point, else 1 + index in worst_first
    fig = Figure(figsize=(max(5, 1.2 * len(xs) + 2.5), max(2.5, 0.7 * len(ys) + 1.8)), dpi=100)
    ax = fig.add_subplot()
    for (i, j), counts in cells.items():
        worst = min(counts, key=worst_first.index)
        grid[i][j] = 1 + worst_first.index(worst)
        text = worst if len(counts) == 1 else "\n".join(
            f"{n} {s}" for s, n in sorted(counts.items(), key=lambda kv: worst_first.index(kv[0])))
        ax.text(j, i, text, ha="center", va="center", color="white", fontsize="small")
    cmap = ListedColormap([_MISSING_COLOR] + [STATUS_COLORS[s] for s in worst_first])
    ax.imshow(grid, cmap=cmap, vmin=0, vmax=len(worst_first), aspect="auto")
    ax.set_xticks(range(len(xs)), xs, rotation=30 if len(xs) > 6 else 0)
    ax.set_yticks(range(len(ys)), ys if y_key else [""])
    ax.set_xlabel(x_key)
    if y_key:
        ax.set_ylabel(y_key)
    ax.set_title("Status of the points (OOM map; a cell shows its worst)")
    return _save(fig, path)


def plot_min_memory(frame: pd.DataFrame, path: Path) -> bool:
    """The probes of each minimum-memory search on the capacity axis (completed or not) and
    the answer, one row per (allocation mode, threshold)."""
    probes = frame[frame[KIND] == RowKind.probe] if KIND in frame else frame.iloc[0:0]
    answers = frame[frame[KIND] == RowKind.min_memory] if KIND in frame else frame.iloc[0:0]
    probes = probes[probes[DEVICE_CAPACITY_BYTES].notna()] \
        if DEVICE_CAPACITY_BYTES in probes else probes.iloc[0:0]
    if answers.empty:
        return False
    scale, unit = byte_unit(probes[DEVICE_CAPACITY_BYTES].max() if not probes.empty else 0)
    fig = Figure(figsize=(10, 1.0 * len(answers) + 2), dpi=100)
    ax = fig.add_subplot()
    labels = []
    mode_col, thr_col = MODE, THRESHOLD
    for i, (_, ans) in enumerate(answers.iterrows()):
        labels.append(f"{ans[mode_col]} t={ans[thr_col]:g}")
        mine = probes[(probes[mode_col] == ans[mode_col]) & (probes[thr_col] == ans[thr_col])]
        for status, group in mine.groupby(STATUS):
            ax.plot(group[DEVICE_CAPACITY_BYTES] / scale, [i] * len(group), "o",
                    color=STATUS_COLORS.get(status, "black"), alpha=0.7)
        if pd.notna(ans.get(MIN_CAPACITY)):
            ax.plot([ans[MIN_CAPACITY] / scale], [i], "|", color="black", markersize=22)
            ax.annotate(human_bytes(ans[MIN_CAPACITY]), (ans[MIN_CAPACITY] / scale, i),
                        textcoords="offset points", xytext=(0, 12), ha="center", fontsize="small")
    for status in (RunStatus.ok, RunStatus.oom):
        ax.plot([], [], "o", color=STATUS_COLORS[status], label=f"probe: {status}")
    ax.plot([], [], "|", color="black", markersize=12, label="smallest capacity that completes")
    ax.set_yticks(range(len(labels)), labels)
    ax.set_ylim(-0.7, len(labels) - 0.3)
    ax.set_xlabel(f"device capacity ({unit})")
    ax.set_title("Minimum-memory search: probes and answer")
    ax.grid(alpha=0.3, axis="x")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return _save(fig, path)


def plot_zero3(frame: pd.DataFrame, path: Path) -> bool:
    """Per ZeRO-3 strategy: all-gathers per iteration, and host time of fetch and release with
    the wait and the bubble, averaged over the points of that strategy."""
    if "zero3_strategy" not in frame or frame["zero3_strategy"].dropna().empty:
        return False
    cols = ["zero3_fetch_host_s", "zero3_release_host_s", "zero3_wait_s", "zero3_bubble_s"]
    data = frame.dropna(subset=["zero3_strategy"]).groupby("zero3_strategy")[
        [c for c in ["zero3_num_allgathers_per_iteration", *cols] if c in frame]].mean()
    fig = Figure(figsize=(11, 4.5), dpi=100)
    ax_ag, ax_host = fig.subplots(1, 2)
    names = [str(s) for s in data.index]
    if "zero3_num_allgathers_per_iteration" in data:
        ax_ag.bar(names, data["zero3_num_allgathers_per_iteration"], color="tab:blue")
    ax_ag.set_title("All-gathers per iteration")
    bottom = [0.0] * len(names)
    for col in (c for c in cols if c in data):
        values = (data[col].fillna(0) * 1e3).tolist()
        ax_host.bar(names, values, bottom=bottom, label=col.removeprefix("zero3_").removesuffix("_s"))
        bottom = [b + v for b, v in zip(bottom, values)]
    ax_host.set_title("Host time per iteration (ms)")
    ax_host.legend(fontsize="small")
    for ax in (ax_ag, ax_host):
        ax.set_xlabel("zero3.strategy")
        ax.grid(alpha=0.3, axis="y")
    return _save(fig, path)


def _label(value) -> str:
    return "-" if value is None or (not isinstance(value, str) and pd.isna(value)) else str(value)


def _ordered(column: pd.Series) -> list[str]:
    """Distinct values as labels, by size (``64MiB`` < ``1GiB``) or number when they parse."""
    def key(label: str):
        try:
            return (0, parse_bytes(label), label)
        except ConfigError:
            return (1, 0, label)
    return sorted({_label(v) for v in column}, key=key)


def _save(fig: Figure, path: Path) -> bool:
    fig.tight_layout()
    save_png(fig, path)
    return True


def save_png(fig: Figure, path: Path) -> None:
    """``fig`` as a PNG at ``path``, whole and never through a planted link."""
    write_with(path, lambda buffer: fig.savefig(buffer, format="png"))
