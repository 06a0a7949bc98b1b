"""The import layers of pyproject.toml's [tool.importlinter] hold, and `lint-imports` would
catch an upward import: the same contracts on a copy of the packages with five planted."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from orchestrator.config import REPO_ROOT

CONTRACTS = ("orchestrator-layers", "actors-layers", "capture-beside-replay",
             "fake-device-alone", "api-on-top", "actors-below-orchestrator", "no-import-loops")


def _lint_imports(root: Path) -> subprocess.CompletedProcess:
    """``lint-imports`` with ``root``'s pyproject.toml over ``root``'s packages."""
    script = Path(sys.executable).with_name("lint-imports")
    assert script.is_file(), f"{script} missing: pip install 'import-linter>=2.0' (test extra)"
    return subprocess.run([str(script), "--no-cache"], cwd=root, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(root)})


def _kept_and_broken(output: str) -> tuple[int, int]:
    last = [line for line in output.splitlines() if line.startswith("Contracts:")][-1]
    words = last.replace(",", "").split()  # Contracts: N kept, M broken.
    return int(words[1]), int(words[3])


def test_the_repository_keeps_every_import_contract():
    proc = _lint_imports(REPO_ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _kept_and_broken(proc.stdout) == (len(CONTRACTS), 0), proc.stdout


def test_an_upward_import_breaks_its_contract(tmp_path):
    for package in ("tracefleet", "orchestrator", "actors"):
        shutil.copytree(REPO_ROOT / package, tmp_path / package,
                        ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO_ROOT / "pyproject.toml", tmp_path)
    # the ground floor reaching up to a study, the rank side reaching into the driver, and
    # a report reaching up to the Python API
    with open(tmp_path / "orchestrator" / "units.py", "a") as f:
        f.write("\nfrom orchestrator.studies import sweep  # noqa: E402,F401\n")
    with open(tmp_path / "orchestrator" / "reports" / "predict_table.py", "a") as f:
        f.write("\nimport tracefleet.api  # noqa: E402,F401\n")
    with open(tmp_path / "actors" / "hardlink.py", "a") as f:
        f.write("\nimport orchestrator.results  # noqa: E402,F401\n")
    # a loop hidden inside a function: the archive reader calling back into the loader that
    # reads through it (loader -> source -> archive)
    with open(tmp_path / "actors" / "trace" / "archive.py", "a") as f:
        f.write("\n\ndef _planted():\n    from actors.trace import loader  # noqa: F401\n")
    # the fake device reaching into the workloads it runs
    with open(tmp_path / "actors" / "capture" / "fake" / "fake_values.py", "a") as f:
        f.write("\nfrom actors.capture.workloads import config  # noqa: E402,F401\n")
    proc = _lint_imports(tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert _kept_and_broken(proc.stdout) == (len(CONTRACTS) - 5, 5), proc.stdout
    assert "actors.capture.fake.fake_values -> actors.capture.workloads" in proc.stdout, \
        proc.stdout
    assert "No cycles are allowed in actors.trace" in proc.stdout, proc.stdout
    assert "orchestrator.units -> orchestrator.studies.sweep" in proc.stdout, proc.stdout
    assert "actors.hardlink -> orchestrator.results" in proc.stdout, proc.stdout
    assert "orchestrator.reports.predict_table -> tracefleet.api" in proc.stdout, proc.stdout
