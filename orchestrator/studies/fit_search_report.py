"""What ``experiment=fit_search`` leaves behind (orchestrator/fit_search.py): a progress line and
a results row per probe (orchestrator/results.py: rows/, results.csv, results.parquet),
``fit_search.json`` with the answer per axis, ``fit_search_<axis>.png`` per axis (reserved
peak against the axis value, with the usable capacity and the error band), and the answers
as a rich table on the console.
"""
from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path

import orjson
from matplotlib.figure import Figure

from orchestrator.outputs import FIT_SEARCH_JSON
from orchestrator.reports.plots import save_png
from orchestrator.studies.fit_search_config import AC_ORDER, FitSearchRunConfig
from actors.atomic_file import atomic_write
from orchestrator.results import ResultsStore, RowKind, make_row
from orchestrator.status import RunStatus
from orchestrator.units import byte_unit, human_bytes

PROBE = RowKind.fit_search_probe.value  # the kind of a probe's results row
# the command-line key of each axis (a row carries its value under that column)
OVERRIDE_KEYS = {"batch_size": "workload.batch_size", "seq_len": "workload.seq_len",
                 "world_size": "world_size",
                 "activation_checkpointing": "workload.activation_checkpointing",
                 "layout": "workload.parallelism"}
VERDICT_COLORS = {"fits": "#2ca02c", "too_close": "#ff9f0e", "oom": "#c51b7d"}


class FitSearchRecorder:
    """Rows and progress lines as probes finish; the summary, plots and table at the end."""

    def __init__(self, out_dir: Path, cfg: FitSearchRunConfig):
        self.out_dir, self.cfg = Path(out_dir), cfg
        self.store = ResultsStore(self.out_dir)

    def probe(self, record: dict) -> None:
        """One probe: its results row, and one progress line."""
        override = f"{OVERRIDE_KEYS[record['axis']]}={record['value']}"
        self.store.put(make_row(PROBE, f"{PROBE} {override}", [override], RunStatus.ok, None, None,
                                {k: v for k, v in record.items() if k != "value"},
                                value=str(record["value"])))
        print(f"fit_search {record['axis']} probe {record['num_probe']}/"
              f"{self.cfg.fit_search.max_probes}: {override} -> {record['verdict']} (reserved "
              f"{human_bytes(record['predicted_reserved_peak_bytes'])} of "
              f"{human_bytes(record['usable_capacity_bytes'])} usable, headroom "
              f"{human_bytes(record['headroom_bytes'])}, {record['probe_s']:.1f} s"
              + (", the same job as an earlier probe" if record["memoized"] else "") + ")",
              flush=True)

    def finish(self, answers: list, total_s: float) -> dict:
        """``fit_search.json``, the plots and the console table; returns the summary."""
        summary = {
            "answers": {a.axis: {"best": a.best, "first_failing": a.first_failing,
                                 "num_probes": a.num_probes, "reason": a.reason,
                                 "plot": _plot_name(a.axis),
                                 **({"others": a.others} if a.others else {})}
                        for a in answers},
            "job": {"world_size": self.cfg.world_size, "target": str(self.cfg.target.name),
                    "batch_size": self.cfg.workload.batch_size,
                    "seq_len": self.cfg.workload.seq_len,
                    "activation_checkpointing": str(self.cfg.workload.activation_checkpointing),
                    "layout": self.cfg.workload.parallelism.describe(self.cfg.world_size)
                    if self.cfg.world_size else None},
            "fit_search": orjson.loads(orjson.dumps(asdict(self.cfg.fit_search), default=str)),
            "error_band": self.cfg.predict.error_band,
            "num_probes": sum(a.num_probes for a in answers),
            # probes of the job itself after the first reuse its prediction
            "num_predictions": sum(not p["memoized"] for a in answers for p in a.probes),
            "total_s": total_s,
            "finished_at": time.time(),
        }
        for a in answers:
            if not plot_axis(a.axis, a.probes, self.out_dir / _plot_name(a.axis),
                             keep=[v for v in (a.best, a.first_failing) if v is not None]):
                summary["answers"][a.axis]["plot"] = None
        atomic_write(self.out_dir / FIT_SEARCH_JSON,
                     orjson.dumps(summary, option=orjson.OPT_INDENT_2))
        print_answers(summary)
        return summary


def _plot_name(axis: str) -> str:
    return f"fit_search_{axis}.png"


ANSWER_COLUMNS = ["axis", "job", "best that fits", "first that does not", "probes", "note"]


def answers_title(summary: dict) -> str:
    return f"fit_search: best value that fits with the {summary['error_band']:.0%} error band"


def answer_rows(summary: dict) -> list[list[str]]:
    """The answer per axis (the job's own value beside it), as ``ANSWER_COLUMNS``' strings:
    the console's table and the page's."""
    return [[axis, str(summary["job"][axis]), "-" if a["best"] is None else str(a["best"]),
             "-" if a["first_failing"] is None else str(a["first_failing"]),
             str(a["num_probes"]), a["reason"] or ""] for axis, a in summary["answers"].items()]


def print_answers(summary: dict) -> None:
    """The answers as a rich table."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=answers_title(summary))
    for col in ANSWER_COLUMNS:
        table.add_column(col)
    for row in answer_rows(summary):
        table.add_row(*row)
    Console(width=120).print(table)
    for other in summary["answers"].get("layout", {}).get("others", ()):
        print(f"fit_search layout {other['layout']}: {other['verdict']}: {other['reason']}")
    print(f"fit_search: {summary['num_probes']} probes ({summary['num_predictions']} "
          f"predictions) in {summary['total_s']:.1f} s")


def plot_axis(axis: str, probes: list[dict], path: Path, keep=()) -> bool:
    """Reserved (and allocated) peak of each probe against the axis value, coloured by verdict,
    with the usable capacity and the band below it where the verdict is ``too_close`` (reserved
    x (1 + error band) above the capacity); False (nothing written) without probes. ``keep``:
    the axis' answer (best, first failing), whose labels are written first where crowded."""
    if not probes:
        return False
    if axis == "activation_checkpointing":
        order = [str(level) for level in AC_ORDER]
        probes = sorted(probes, key=lambda p: order.index(str(p["value"])))
        xs = [order.index(str(p["value"])) for p in probes]
    elif axis == "layout":  # cheapest first, as probed
        order = [str(p["value"]) for p in probes]
        xs = list(range(len(order)))
    else:
        probes = sorted(probes, key=lambda p: p["value"])
        xs = [p["value"] for p in probes]
    usable, band = probes[0]["usable_capacity_bytes"], probes[0]["error_band"]
    scale, unit = byte_unit(max(usable, *(p["predicted_reserved_peak_bytes"] for p in probes)))
    reserved = [p["predicted_reserved_peak_bytes"] / scale for p in probes]
    fig = Figure(figsize=(8, 4.5), dpi=100)
    ax = fig.add_subplot()
    ax.plot(xs, reserved, "-", color="tab:blue", alpha=0.5, label="reserved peak*")
    ax.errorbar(xs, reserved, yerr=[r * band for r in reserved], fmt="none", ecolor="tab:blue",
                alpha=0.5, capsize=3, label=f"error band ±{band:.0%}")
    ax.plot(xs, [p["predicted_allocated_peak_bytes"] / scale for p in probes], "--",
            color="tab:gray", alpha=0.7, label="allocated peak*")
    for verdict, color in VERDICT_COLORS.items():
        mine = [(x, r) for x, r, p in zip(xs, reserved, probes) if p["verdict"] == verdict]
        if mine:
            ax.plot(*zip(*mine), "o", color=color, label=verdict)
    ax.axhline(usable / scale, color="black", label="usable capacity")
    ax.axhspan(usable / scale / (1 + band), usable / scale, color="#ff9f0e", alpha=0.15,
               label="too_close zone")
    if axis in ("activation_checkpointing", "layout"):
        ax.set_xticks(range(len(order)), order, rotation=20 if axis == "layout" else 0)
    else:
        if max(xs) > 4 * min(xs):
            ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])  # the probed values, not powers of two
        ax.minorticks_off()
    ax.set_xlabel(OVERRIDE_KEYS[axis])
    ax.set_ylabel(f"bytes ({unit})")
    ax.set_ylim(bottom=0)
    ax.set_title(f"fit_search {axis}\nreserved peak (* predicted) against the usable capacity",
                 fontsize="medium")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    if axis not in ("activation_checkpointing", "layout"):
        _label_without_overlap(fig, ax, xs, list(keep))
    save_png(fig, path)
    return True


def _label_without_overlap(fig: Figure, ax, xs: list, first: list) -> None:
    """Every probed value keeps its tick; a bisection's last probes lie pixels apart, so only
    labels that do not overlap one already kept are written, the answers' first."""
    fig.draw_without_rendering()
    boxes = {x: label.get_window_extent().expanded(1.15, 1.0)
             for x, label in zip(xs, ax.get_xticklabels())}
    kept: list = []
    for x in [*first, *sorted(xs)]:
        if x not in kept and not any(boxes[x].overlaps(boxes[k]) for k in kept):
            kept.append(x)
    ax.set_xticks(xs, [str(x) if x in kept else "" for x in xs])
