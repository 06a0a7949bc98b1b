"""Every replay and every rank's collectives go through the public seams: only actors/replay/
builds a ``ReplayEngine`` (``RankSession.compile``/``run``), and only
actors/replay/comm/rank_comm.py creates the process groups and the collective replayer
(``rank_comm``). A script that rebuilt either would miss the next change to the rank path
(tests may build an engine: they test it)."""
from __future__ import annotations

import ast
from pathlib import Path

from orchestrator.config import REPO_ROOT

# the code users and CI run; tests/ are the engine's own tests
SCANNED = ("actors", "orchestrator", "scripts", "tracefleet", "examples")
ALLOWED = {"ReplayEngine": "actors/replay/",
           "ProcessGroups.create": "actors/replay/comm/rank_comm.py",
           "CollectiveReplayer": "actors/replay/comm/rank_comm.py"}


def constructions(root: Path, folders=SCANNED) -> list[str]:
    """``path:line name`` of each call of a guarded constructor under ``root``'s ``folders``
    outside the place ``ALLOWED`` gives it."""
    found = []
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            for call in ast.walk(ast.parse(path.read_text(), rel)):
                if not isinstance(call, ast.Call):
                    continue
                for name in _names(call.func) & ALLOWED.keys():
                    if not rel.startswith(ALLOWED[name]):
                        found.append(f"{rel}:{call.lineno} {name}")
    return found


def _names(func: ast.expr) -> set[str]:
    """The names a call's callee goes by: ``f``, or ``obj.attr`` and ``attr``."""
    if isinstance(func, ast.Name):
        return {func.id}
    if not isinstance(func, ast.Attribute):
        return set()
    owner = func.value.id if isinstance(func.value, ast.Name) else ""
    return {func.attr, f"{owner}.{func.attr}"}


def test_only_the_seams_build_the_engine_and_the_groups():
    assert constructions(REPO_ROOT) == []


def test_a_script_that_builds_its_own_engine_or_groups_is_named(tmp_path):
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "bench_x.py").write_text(
        "from actors.replay.engine import ReplayEngine\n"
        "engine = ReplayEngine(trace, cfg)\n"
        "groups = ProcessGroups.create(table, 0, 1, 'gloo', 60)\n"
        "comm = replayer.CollectiveReplayer(groups, device)\n")
    (tmp_path / "actors" / "replay").mkdir(parents=True)
    (tmp_path / "actors" / "replay" / "session.py").write_text("e = ReplayEngine(t, c)\n")
    assert constructions(tmp_path, ("scripts", "actors")) == [
        "scripts/bench_x.py:2 ReplayEngine", "scripts/bench_x.py:3 ProcessGroups.create",
        "scripts/bench_x.py:4 CollectiveReplayer"]
