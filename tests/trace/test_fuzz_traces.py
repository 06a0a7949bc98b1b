"""A seeded slice of the trace fuzz campaign (scripts/fuzz_traces.py): mutated real traces
through load, pre-flight and a meta dry run end in a project error or a replay, never in a
traceback, a hang or a crash."""
from __future__ import annotations

import os
import subprocess
import sys

import orjson
import pytest
from orchestrator.config import REPO_ROOT

REPO = REPO_ROOT
DEMO = REPO / "demo" / "traces"


def test_a_seeded_slice_of_the_fuzz_campaign_has_no_traceback_hang_or_crash(public_trace_dir):
    sources = [DEMO / "gpt_dp_4" / "rank-0.et.json.gz", DEMO / "gpt_zero3_leaf_2" / "rank-1.et.json.gz",
               public_trace_dir / "linear_et.json.gz", public_trace_dir / "dlrm_pytorch_et.tar.gz"]
    missing = [s for s in sources if not s.exists()]
    if missing:
        pytest.skip(f"absent: {missing}")
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "fuzz_traces.py"), "--n", "48",
                          "--seed", "11", "--timeout-s", "60", "--examples", "3",
                          "--sources", *map(str, sources)],
                         capture_output=True, timeout=600, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    summary = orjson.loads(out.stdout.splitlines()[-1])
    assert summary["n"] == 48 and summary["seed"] == 11
    assert (summary["tracebacks"], summary["hangs"], summary["crashes"]) == (0, 0, 0), \
        summary["examples"]
    # both ends are exercised: some mutations are refused, some still replay
    assert summary["clear_errors"] > 0 and summary["replayed"] > 0
    assert summary["clear_errors"] + summary["replayed"] == 48
    assert out.returncode == 0, out.stderr.decode()[-2000:]
