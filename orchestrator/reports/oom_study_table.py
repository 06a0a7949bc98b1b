"""The OOM study as people read it: the compact table (console markdown and report), and one
plot of each mode's minimum capacity beside DeepSpeed's estimate against the device.

Rows come from orchestrator/studies/oom_study.py's ``study`` (dicts) or from the results table
(``ResultsStore.frame()`` records, where missing values are ``pd.NA``/NaN); both read the same.
"""
from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
from matplotlib.figure import Figure

from orchestrator.reports.plots import STATUS_COLORS, save_png
from orchestrator.results import CAPACITY, KIND, MIN_CAPACITY, MODE, STATUS, STUDY_PART, \
    THRESHOLD, RowKind, StudyPart
from orchestrator.status import RunStatus
from orchestrator.units import byte_unit, human_bytes

_ESTIMATE_COLOR = "#7f7f7f"


def study_table(rows) -> list[dict]:
    """One line per replay on the device (with its mode's minimum capacity), per flush replay
    (with the minimum at its threshold, when searched) and per estimate, as display strings."""
    rows = [r for r in rows if _present(r.get(KIND))]
    minimum = _minimums(rows)
    device = _device(rows)
    fits = f"fits {human_bytes(device)}" if device is not None else "fits the device"
    table = []
    for r in rows:
        if r[KIND] == RowKind.study:
            on_device = r.get(STUDY_PART) == StudyPart.device
            threshold = float(r[THRESHOLD])
            # A flush keeps the replay going by re-making flushed tensors with synthetic data;
            # the job itself has no such escape: past its capacity it is out of memory.
            flushing = (f", threshold {threshold:g} (flushed tensors re-made with synthetic "
                        "data: the real job would still be out of memory)") if threshold < 1 \
                else ""
            table.append({
                "what": f"replay {r[MODE]}{flushing}",
                "capacity": human_bytes(r[CAPACITY]), "status": r[STATUS],
                "peak (accounted)": _bytes(r.get("accounted_peak_bytes"))
                if r[STATUS] == RunStatus.ok
                else _oom_where(r),
                "flushes": _int(r.get("num_flushes")),
                "minimum capacity": _bytes(minimum.get((r[MODE], threshold))),
                fits: ("yes" if r[STATUS] == RunStatus.ok else "no") if on_device else "-"})
        elif r[KIND] == RowKind.estimate:
            gpu = r.get("estimated_gpu_bytes")
            table.append({
                "what": f"DeepSpeed ZeRO-3 estimate, model states only ({r['options']})",
                "capacity": "-", "status": "-", "peak (accounted)": f"{_bytes(gpu)} per GPU",
                "flushes": "-", "minimum capacity": "-",
                fits: "-" if device is None or not _present(gpu)
                else ("yes" if gpu <= device else "no")})
    return table


def markdown(table: list[dict]) -> str:
    """``table`` (from ``study_table``) as a markdown pipe table."""
    if not table:
        return ""
    head = list(table[0])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(row[k]) for k in head) + " |" for row in table]
    return "\n".join(lines)


def plot_oom_study(frame: pd.DataFrame, path: Path) -> bool:
    """Bars: each searched (mode, threshold)'s minimum capacity and DeepSpeed's per-GPU
    estimates, green when under the device capacity (the dashed line), magenta when over."""
    rows = frame.to_dict("records") if KIND in frame else []
    device = _device(rows)
    if device is None:
        return False
    bars = [(f"{mode}" + (f", threshold {t:g}" if t < 1 else "") + ": replay minimum", value)
            for (mode, t), value in _minimums(rows).items() if _present(value)]
    bars += [(f"DeepSpeed estimate ({r['options'].replace(', zero_init=1', '')})",
              r["estimated_gpu_bytes"]) for r in rows if r[KIND] == RowKind.estimate]
    if not bars:
        return False
    scale, unit = byte_unit(max([device, *(v for _, v in bars)]))
    fig = Figure(figsize=(10, 0.5 * len(bars) + 1.8), dpi=100)
    ax = fig.add_subplot()
    for i, (label, value) in enumerate(bars):
        fits = RunStatus.ok if value <= device else RunStatus.oom
        ax.barh(i, value / scale, color=STATUS_COLORS[fits],
                hatch="//" if label.startswith("DeepSpeed") else None,
                edgecolor=_ESTIMATE_COLOR if label.startswith("DeepSpeed") else None)
        ax.annotate(human_bytes(value), (value / scale, i), textcoords="offset points",
                    xytext=(4, 0), va="center", fontsize="small")
    ax.axvline(device / scale, color="black", linestyle="--",
               label=f"device {human_bytes(device)}")
    ax.set_yticks(range(len(bars)), [label for label, _ in bars], fontsize="small")
    ax.invert_yaxis()
    ax.set_xlabel(f"bytes per GPU ({unit}); hatched: model states only")
    ax.set_title("OOM study: minimum capacity per mode vs. DeepSpeed's estimate")
    ax.legend(fontsize="small", loc="lower right")
    ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    save_png(fig, path)
    return True


def _minimums(rows) -> dict:
    return {(r[MODE], float(r[THRESHOLD])): r.get(MIN_CAPACITY)
            for r in rows if r[KIND] == RowKind.min_memory}


def _device(rows) -> int | None:
    return next((int(r[CAPACITY]) for r in rows
                 if r[KIND] == RowKind.study and r.get(STUDY_PART) == StudyPart.device), None)


def _oom_where(row) -> str:
    """Where a replay stopped and what it asked for: its OOM node, or outside an op when the
    engine names none (storages a mode allocates up front, an extension's allocation)."""
    if row[STATUS] != RunStatus.oom:
        return "-"
    where = "outside an op" if not _present(row.get("oom_node_id")) else \
        f"at node {_int(row['oom_node_id'])} {_text(row.get('oom_op'))}".strip()
    return f"OOM {where} ({_bytes(row.get('oom_requested_bytes'))} requested)"


def _present(value) -> bool:
    return value is not None and value is not pd.NA and \
        not (isinstance(value, float) and math.isnan(value))


def _bytes(value) -> str:
    return human_bytes(value) if _present(value) else "-"


def _int(value) -> str:
    return str(int(value)) if _present(value) else "-"


def _text(value) -> str:
    return str(value) if _present(value) else ""
