"""Every output file is named once, in orchestrator/outputs.py: no other module of the product
or script spells one of those file names as a string of its own (a renamed file would leave the
copy behind), and no two outputs share a name."""
from __future__ import annotations

import ast
from pathlib import Path

from orchestrator import outputs
from orchestrator.config import REPO_ROOT

SCANNED = ("actors", "orchestrator", "scripts", "tracefleet")
# the one home of each name: the capture's meta.json is named by the layer that reads it
HOMES = {"orchestrator/outputs.py", "actors/trace/meta_file.py"}


def output_names() -> dict[str, str]:
    """file name -> its constant in orchestrator/outputs.py (the folders' names, ``report``,
    ``memory``, ``rows``, are words other strings use too)."""
    return {value: name for name, value in vars(outputs).items()
            if name.isupper() and isinstance(value, str) and "." in value}


def spelled_outside(root: Path, names, folders=SCANNED) -> list[str]:
    """``path:line 'name'`` of each string constant equal to one of ``names`` in a module under
    ``root``'s ``folders`` other than their homes (docstrings are prose: not counted)."""
    found = []
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if rel in HOMES:
                continue
            tree = ast.parse(path.read_text(), rel)
            docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                          if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef))
                          and n.body and isinstance(n.body[0], ast.Expr)}
            found += [f"{rel}:{n.lineno} {n.value!r}" for n in ast.walk(tree)
                      if isinstance(n, ast.Constant) and n.value in names
                      and id(n) not in docstrings]
    return found


def test_each_output_has_its_own_name():
    constants = [v for k, v in vars(outputs).items() if k.isupper() and isinstance(v, str)]
    assert len(constants) == len(set(constants)) > 20


def test_no_module_spells_an_output_name_itself():
    assert spelled_outside(REPO_ROOT, output_names()) == []


def test_a_spelled_name_is_found(tmp_path):
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "bench_x.py").write_text(
        '"""Reads summary.json."""\nimport json\n'
        'summary = json.loads((run_dir / "summary.json").read_text())\n'
        'note = f"see {run_dir}/summary.json"\n')
    assert spelled_outside(tmp_path, output_names(), ("scripts",)) == \
        ["scripts/bench_x.py:3 'summary.json'"]


def test_the_run_dir_joins_the_names(tmp_path):
    run = outputs.RunDir(str(tmp_path))
    assert (run.summary, run.prediction, run.meta, run.preflight, run.results_csv) == \
        tuple(tmp_path / n for n in ("summary.json", "prediction.json", "meta.json",
                                     "preflight.json", "results.csv"))
