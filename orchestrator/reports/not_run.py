"""Warning lines naming the recorded ops a replay did not run as recorded (the rank report's
``not_run_ops``: actors/replay/report.py), for the run's console summary and the prediction
table: what was skipped, failed, stood in for or left out by the loader, with its bytes."""
from __future__ import annotations

from orchestrator.units import human_bytes

MAX_LINES = 5
_EFFECT = {"skipped": "outputs missing from the peak", "failed": "outputs missing from the peak",
           "stand-in": "outputs made from the trace's shapes, not computed",
           "dropped": "not replayed"}


def not_run_lines(not_run: list[dict], rank=None) -> list[str]:
    """One line per group of ops that did not run as recorded (the largest first, at most
    ``MAX_LINES`` and a line counting the rest); empty when every op ran. Stand-ins that make
    no bytes (``aten::item``'s Python number on meta) change no figure: not printed."""
    not_run = [r for r in not_run or () if r["bytes"] or r["kind"] != "stand-in"]
    if not not_run:
        return []
    where = f" (rank {rank})" if rank is not None else ""
    lines = [f"warning{where}: {r['num_ops']} x {r['op']} {r['kind']}: {r['why']} -> "
             f"{human_bytes(r['bytes'])} {_EFFECT.get(r['kind'], '')}".rstrip()
             for r in not_run[:MAX_LINES]]
    rest = not_run[MAX_LINES:]
    if rest:
        lines.append(f"warning{where}: {sum(r['num_ops'] for r in rest)} more op(s) of "
                     f"{len(rest)} other kind(s) did not run as recorded, "
                     f"{human_bytes(sum(r['bytes'] for r in rest))} (summary.json: not_run_ops)")
    return lines
