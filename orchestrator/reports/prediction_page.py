"""``prediction.html``: one prediction (orchestrator/studies/predict.py) as a page, beside
``prediction.json``. Self-contained like the run report (orchestrator/reports/html_report.py):
its PNGs (also written under ``prediction/``) are embedded, no script, no link leaves it.

It shows the verdict and its band, the figures of the table, the caching allocator model's
memory over the last iteration (allocated bytes stacked by category up to the allocated line,
the reserved line, the usable capacity with the error band below it, the reserved peak
marked), the reserved bytes per stream at that peak, the breakdown of the accounted peak, the
snapshot files, and the plots of a fit_search when one ran.
"""
from __future__ import annotations

import html
from pathlib import Path

from matplotlib.figure import Figure

from orchestrator.reports.plots import save_png
from orchestrator.reports.predict_notes import breakdown_help, kernel_lines, outside_breakdown
from orchestrator.reports.predict_table import prediction_table
from orchestrator.units import byte_unit, human_bytes
from orchestrator.outputs import MEMORY_PNG, PREDICTION_HTML, PREDICTION_PLOTS_DIR, STREAMS_PNG
from orchestrator.reports.html_parts import grid, img, kv_table
from actors.atomic_file import atomic_write

_VERDICT_COLORS = {"fits": "#2ca02c", "too_close": "#ff9f0e", "oom": "#c51b7d"}
_SERIES_COLORS = {"parameters": "#4e79a7", "gradients": "#f28e2c", "optimizer_state": "#e15759",
                  "buffers": "#76b7b2", "communication": "#59a14f", "activations": "#edc949",
                  "made_inside": "#af7aa1", "temporaries": "#ff9da7",
                  "cublas_workspace": "#9c755f"}
_CSS = """body{font-family:sans-serif;margin:24px;color:#222;max-width:1200px}
table{border-collapse:collapse;font-size:13px;margin:8px 0 20px}
th,td{border:1px solid #ccc;padding:3px 8px;text-align:right}th{background:#f3f3f3}
td:first-child,th:first-child{text-align:left}img{max-width:100%;border:1px solid #ddd;margin:6px 0}
.verdict{font-size:22px;font-weight:bold;padding:6px 12px;display:inline-block;color:#fff}"""


def write_prediction_page(out_dir, prediction: dict, extra_plots=(), extra_tables=()) -> Path:
    """Write ``prediction.html`` (and its PNGs under ``prediction/``) into ``out_dir`` for
    ``prediction`` (what ``prediction.json`` holds); ``extra_tables``: ``(title, header,
    rows)`` and ``extra_plots``: ``(title, png path)`` shown after it (fit_search's answers
    and plots). Returns the page's path."""
    out = Path(out_dir)
    plots = out / PREDICTION_PLOTS_DIR
    plots.mkdir(parents=True, exist_ok=True)
    title = prediction_table(prediction).splitlines()[0]
    p = prediction
    parts = [_verdict(p), "<h2>Figures</h2>", kv_table(_figures(p))]
    timeline = p.get("memory_timeline")
    if timeline and timeline.get("points"):
        plot_memory(p, plots / MEMORY_PNG)
        parts += ["<h2>Memory over the iteration</h2>", _caption(timeline),
                  img(plots / MEMORY_PNG, "memory over the iteration")]
        peak = timeline.get("reserved_peak") or {}
        if peak.get("by_stream"):
            plot_streams(peak, plots / STREAMS_PNG)
            parts += ["<h2>Reserved at the peak, by stream</h2>", kv_table(
                (name, human_bytes(b)) for name, b in peak["by_stream"].items()),
                img(plots / STREAMS_PNG, "reserved bytes per stream at the peak")]
    else:
        parts.append("<p>No memory timeline in this prediction (made without an output "
                     "folder, or by an older tracefleet).</p>")
    total = sum(p["breakdown"].values()) or 1
    meaning = breakdown_help(p["breakdown"])
    parts += ["<h2>The accounted peak by category</h2>", kv_table(
        (name, f"{human_bytes(b)} ({100 * b / total:.0f}%): {meaning.get(name, '')}")
        for name, b in sorted(p["breakdown"].items(), key=lambda kv: -kv[1]) if b)]
    kernels = kernel_lines(p.get("kernel_dispatch"))
    if kernels:
        parts += ["<h2>Kernels of the target GPU</h2>", "<p>The capture ran on fake CPU tensors; "
                  "these ops ran the kernels the target GPU picks instead of the CPU's "
                  "(docs/capture.md, \"CPU and CUDA paths\").</p>",
                  "<ul>" + "".join(f"<li>{html.escape(line)}</li>" for line in kernels) + "</ul>"]
    if p.get("snapshots"):
        parts += ["<h2>Snapshots</h2>", "<p>In the layout of <code>torch.cuda.memory._snapshot()"
                  "</code>: open them in PyTorch's memory_viz page, or compare one with a "
                  "snapshot recorded on a GPU (<code>tracefleet-compare</code>).</p>", kv_table(
                      (f"rank {rank}", name) for rank, name in p["snapshots"].items())]
    for label, header, rows in extra_tables:
        parts += [f"<h2>{html.escape(label)}</h2>", grid(header, rows)]
    for label, path in extra_plots:
        parts += [f"<h2>{html.escape(label)}</h2>", img(Path(path), label)]
    page = out / PREDICTION_HTML
    # whole or not at all: a full disk leaves no half page
    atomic_write(page, (f"<!DOCTYPE html>\n<html><head><meta charset='utf-8'><title>"
                        f"{html.escape(title)}</title><style>{_CSS}</style></head><body><h1>"
                        f"{html.escape(title)}</h1>\n" + "\n".join(parts)
                        + "\n</body></html>\n").encode())
    return page


def _verdict(p: dict) -> str:
    band = p["error_band"] * p["predicted_reserved_peak_bytes"]
    color = _VERDICT_COLORS.get(p["verdict"], "#7f7f7f")
    return (f"<p><span class='verdict' style='background:{color}'>{html.escape(p['verdict'])}"
            f"</span> headroom {html.escape(human_bytes(p['headroom_bytes']))}, error band "
            f"{100 * p['error_band']:g}% of the reserved peak = {html.escape(human_bytes(band))}"
            f" ({html.escape(str(p.get('error_band_source', '')))})</p>")


def _figures(p: dict) -> list[tuple[str, str]]:
    op = p.get("peak_op")
    rows = [("allocated peak (predicted)", human_bytes(p["predicted_allocated_peak_bytes"])),
            *outside_breakdown(p),
            ("reserved peak (predicted)", human_bytes(p["predicted_reserved_peak_bytes"])),
            ("usable capacity", human_bytes(p["usable_capacity_bytes"])),
            ("headroom", human_bytes(p["headroom_bytes"])),
            ("accounted peak", human_bytes(p.get("accounted_peak_bytes"))),
            ("op at the accounted peak", f"node {op['node_id']} {op['op']}" if op else "-"),
            ("world size", str(p["world_size"])),
            ("allocator model OOMs / cache releases",
             f"{p.get('num_predicted_ooms', 0)} / {p.get('num_alloc_retries', 0)}")]
    timings = p.get("timings_s") or {}
    if "total_s" in timings:
        rows.append(("time", f"{timings['total_s']:.1f} s"))
    return rows


def _caption(timeline: dict) -> str:
    which = "measured" if timeline.get("measured") else "warm-up"
    peak = timeline.get("reserved_peak") or {}
    elsewhere = peak and peak["iteration"] != timeline["iteration"]
    where = "" if not peak else (
        f" The reserved peak, {html.escape(human_bytes(peak['bytes']))}, is reached at op "
        f"{peak['op_index']} of iteration {peak['iteration']}"
        + (", not the iteration plotted: its red line stays below the peak." if elsewhere
           else "."))
    return (f"<p>Iteration {timeline['iteration']} ({which}), each point the highest allocated "
            f"state of {timeline['ops_per_point']} op(s); the stack is the caching allocator "
            f"model's allocated blocks by what they hold, the reserved line what its segments "
            f"hold.{where}</p>")


def plot_memory(p: dict, path: Path) -> None:
    """Allocated bytes stacked by category with the allocated and reserved lines, the usable
    capacity, its error band below and the reserved peak, over the op index."""
    t = p["memory_timeline"]
    cols = t["columns"]
    points = t["points"]
    x = [pt[0] for pt in points]
    usable = p["usable_capacity_bytes"]
    reserved = max(max(pt[2] for pt in points), p["predicted_reserved_peak_bytes"])
    far = usable > 4 * reserved  # drawn, it would flatten the curves: named in the title
    top = reserved if far else max(reserved, usable)
    scale, unit = byte_unit(top)
    fig = Figure(figsize=(12, 5.2), dpi=100)
    ax, at_peak = fig.subplots(1, 2, sharey=True, width_ratios=[14, 1])
    at = (t.get("allocated_peak") or {}).get("by_series") or {}
    series = [name for name in t["series"]
              if at.get(name) or any(pt[cols.index(name)] for pt in points)]
    colors = [_SERIES_COLORS.get(s, "#bab0ab") for s in series]
    ax.stackplot(x, *[[pt[cols.index(name)] / scale for pt in points] for name in series],
                 labels=series, colors=colors, step="post", alpha=0.9)
    _stack_at_allocated_peak(at_peak, t.get("allocated_peak"), series, colors, scale)
    ax.step(x, [pt[1] / scale for pt in points], where="post", color="black", lw=1.2,
            label="allocated*")
    ax.step(x, [pt[2] / scale for pt in points], where="post", color="#d62728", lw=1.6,
            label="reserved*")
    band = p["error_band"] * p["predicted_reserved_peak_bytes"]
    if not far:
        ax.axhline(usable / scale, color="#333", ls="--", lw=1.2, label="usable capacity")
        ax.axhspan((usable - band) / scale, usable / scale, color="#ff9f0e", alpha=0.18,
                   label=f"error band ({100 * p['error_band']:g}% of the reserved peak)")
    peak = t.get("reserved_peak")
    if peak and peak["iteration"] == t["iteration"] and peak["op_index"] >= 0:
        ax.plot([peak["op_index"]], [peak["bytes"] / scale], marker="v", ms=11,
                color="#d62728", ls="none", label=f"reserved peak {human_bytes(peak['bytes'])}")
    ax.set_xlabel("op index in the iteration")
    ax.set_ylabel(unit)
    ax.set_ylim(0, top * 1.08 / scale)
    off = f"; usable capacity {human_bytes(usable)}, off the scale" if far else ""
    ax.set_title(f"verdict: {p['verdict']}{off}  (* predicted by the caching allocator model)")
    at_peak.legend(*ax.get_legend_handles_labels(), loc="upper left", bbox_to_anchor=(1.05, 1),
                   fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    save_png(fig, path)


def _stack_at_allocated_peak(ax, peak: dict | None, series: list[str], colors: list[str],
                             scale: float) -> None:
    """The allocated peak's categories as one stacked bar: on the timeline a peak held for one
    op is a spike narrower than a pixel, its stack invisible."""
    ax.set_xticks([])
    if not peak or "by_series" not in peak:
        ax.set_axis_off()
        return
    bottom = 0.0
    for name, color in zip(series, colors):
        height = peak["by_series"].get(name, 0) / scale
        ax.bar(0, height, bottom=bottom, color=color, alpha=0.9, width=0.8)
        bottom += height
    ax.plot([0], [peak["bytes"] / scale], marker="_", ms=22, mew=2, color="black")
    ax.set_title(f"allocated peak*\n{human_bytes(peak['bytes'])}\n"
                 f"it. {peak['iteration']}, op {peak['op_index']}", fontsize=8)
    ax.grid(alpha=0.3, axis="y")


def plot_streams(peak: dict, path: Path) -> None:
    """The reserved bytes per stream at the reserved peak, one bar each."""
    names = list(peak["by_stream"])
    values = [peak["by_stream"][n] for n in names]
    scale, unit = byte_unit(max(values))
    fig = Figure(figsize=(8, 0.6 + 0.5 * len(names)), dpi=100)
    ax = fig.add_subplot()
    ax.barh(names, [v / scale for v in values], color="#d62728")
    for i, v in enumerate(values):
        ax.text(v / scale, i, f" {human_bytes(v)}", va="center", fontsize=9)
    ax.set_xlabel(unit)
    ax.set_xlim(0, max(values) * 1.25 / scale)
    ax.invert_yaxis()
    fig.tight_layout()
    save_png(fig, path)
