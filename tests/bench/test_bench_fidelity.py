"""The smoke test of scripts/bench_fidelity.py (tests/support/bench.py)."""
from __future__ import annotations

import pytest

from tests.support.bench import SLOW_TIMEOUT_S, positive, run_bench

pytestmark = pytest.mark.long  # CI's second job (scripts/test.sh --long)


@pytest.mark.slow
@pytest.mark.timeout(SLOW_TIMEOUT_S)
def test_bench_fidelity():
    out = run_bench("fidelity")
    assert set(out["folders"]) == {"gpt_dp_4"}  # quick: the first demo
    for row in out["folders"].values():
        assert len(row["rounds"]) == 1  # quick: one round, original then the replays
        for key in ("original", "faithful", "faithful+host_gaps"):
            assert positive(row["rounds"][0][key]["s"]), key
        assert positive(row["faithful_time_ratio"], row["faithful+host_gaps_time_ratio"],
                         row["faithful_memory_ratio"], row["lazy_memory_ratio"],
                         row["pre_allocate_memory_ratio"])
        assert isinstance(row["targets_met"], bool)
    assert isinstance(out["all_targets_met"], bool)


@pytest.mark.slow
def test_bench_zero3():
    out = run_bench("zero3")
    for figure in ("allgathers_per_step", "fetch_release_host_s_per_step", "step_s"):
        assert positive(*out[figure].values()), figure
    gathers = out["allgathers_per_step"]  # same model, same units: same all-gather counts
    assert gathers["per_module"] == gathers["deepspeed"]
    assert gathers["leaf_coalesced"] == gathers["deepspeed_leaf"]
    assert positive(out["leaf_over_per_module_host"])
