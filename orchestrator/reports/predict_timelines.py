"""Per-role figures and memory timelines of a prediction (orchestrator/studies/predict.py): one
entry per distinct rank trace dry-run, named by its role on a mesh job (the pipeline stage,
the cp rank) or by its rank; ``memory/rank-<r>.csv`` (op index, accounted bytes held after the
op, the most and fewest held since the previous sample) and one plot of them all."""
from __future__ import annotations

from pathlib import Path

from actors.atomic_file import atomic_write
from orchestrator.reports.plots import save_png
from orchestrator.outputs import MEMORY_TIMELINES_PNG
from orchestrator.units import byte_unit



def role_of(mesh: dict | None, roles: dict[str, list[int]] | None, rank: int) -> str:
    """The role of ``rank`` on a mesh job (``rank <r>`` otherwise)."""
    if mesh and roles:
        for name, ranks in roles.items():
            if rank in ranks:
                return name
    return f"rank {rank}"


def per_role(reports: dict[int, dict], roles: dict[str, list[int]] | None,
             mesh: dict | None) -> dict[str, dict]:
    """``{role: figures}`` of every dry-run rank, worst reserved peak first."""
    out = {}
    for rank, r in sorted(reports.items(), key=lambda kv: -kv[1]["predicted_reserved_peak_bytes"]):
        out[role_of(mesh, roles, rank)] = {
            "rank": rank, "predicted_reserved_peak_bytes": r["predicted_reserved_peak_bytes"],
            "predicted_allocated_peak_bytes": r["predicted_allocated_peak_bytes"],
            "accounted_peak_bytes": r["accounted_peak_bytes"], "peak_op": r["peak_op"],
            "timeline": f"memory/rank-{rank}.csv"}
    return out


def write_timelines(out_dir: Path, reports: dict[int, dict], roles_by_name: dict[str, dict]) -> str:
    """The timelines' CSVs and their plot in ``out_dir``; returns the plot's file name."""
    from matplotlib.figure import Figure  # only when writing: predict imports this module

    folder = Path(out_dir) / "memory"
    folder.mkdir(parents=True, exist_ok=True)
    fig = Figure(figsize=(9, 4.5), dpi=100)
    ax = fig.add_subplot()
    peak = max((p[2] for r in reports.values() for p in r["memory_timeline"]), default=1)
    scale, unit = byte_unit(peak)
    for role, figures in roles_by_name.items():
        points = reports[figures["rank"]]["memory_timeline"]
        rows = "".join(",".join(map(str, p)) + "\n" for p in points)
        atomic_write(folder / f"rank-{figures['rank']}.csv",
                     ("op_index,held_bytes,high_bytes,low_bytes\n" + rows).encode())
        if points:
            ax.plot([p[0] for p in points], [p[2] / scale for p in points], label=role)
    ax.set_xlabel("op index (first iteration)")
    ax.set_ylabel(f"accounted bytes held ({unit})")
    ax.set_ylim(bottom=0)
    ax.set_title("memory per role: accounted bytes through one iteration")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    save_png(fig, Path(out_dir) / MEMORY_TIMELINES_PNG)
    return MEMORY_TIMELINES_PNG
