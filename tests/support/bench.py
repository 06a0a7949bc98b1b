"""Running a benchmark script's quick mode for the smoke tests (tests/bench/): the script's
one JSON line, checked against the keys the script declares for a full run."""
from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

from scripts.json_layout import mismatches

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 1500  # a quick run on a loaded machine took over 600 s (a bound, not a speed)
# pytest's bound on the tests that start Ray many times (the default is 300 s): above
# run_bench's own, which fails first and says which script
SLOW_TIMEOUT_S = TIMEOUT_S + 60
SCRIPT_KEYS = object()  # run_bench's default layout: the script's own KEYS


def run_bench(name: str, *args: str, layout=SCRIPT_KEYS) -> dict:
    """``scripts/bench_<name>.py --quick *args`` in a fresh interpreter; its last stdout line,
    checked against ``layout`` (by default the script's ``KEYS``; None: unchecked)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT),
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / f"bench_{name}.py"), "--quick",
                           *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    assert proc.returncode == 0, f"bench_{name}.py --quick failed:\n{proc.stderr[-3000:]}"
    lines = proc.stdout.strip().splitlines()
    assert lines, f"bench_{name}.py printed nothing; stderr:\n{proc.stderr[-2000:]}"
    out = json.loads(lines[-1])
    if layout is SCRIPT_KEYS:
        layout = importlib.import_module(f"scripts.bench_{name}").KEYS
    assert mismatches(out, layout) == [], f"bench_{name}.py's line strays from its KEYS"
    return out


def positive(*values) -> bool:
    return all(isinstance(v, (int, float)) and v > 0 for v in values)
