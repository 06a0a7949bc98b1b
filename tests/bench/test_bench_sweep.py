"""The smoke test of scripts/bench_sweep.py (tests/support/bench.py)."""
from __future__ import annotations

import pytest

from tests.support.bench import SLOW_TIMEOUT_S, positive, run_bench

pytestmark = pytest.mark.long  # CI's second job (scripts/test.sh --long)


@pytest.mark.slow
@pytest.mark.timeout(SLOW_TIMEOUT_S)
def test_bench_sweep():
    out = run_bench("sweep")
    assert out["quick"] and out["sweep_points"] == 2 and positive(out["sweep_over_singles"])
    assert out["min_memory_steps"] >= 3 and positive(out["min_memory_s"])  # >= 1 per mode
    # identical ranks replay once; two distinct traces, two actors (the script checks that
    # every rank reports its own trace's replay)
    for key, num_traces in (("dry_run", 1), ("dry_run_2_traces", 2)):
        run = out[key]
        assert run["world_size"] == 8 and run["num_traces"] == run["num_actors"] == num_traces
        assert len(run["actor_rss_gib"]) == num_traces and positive(*run["actor_rss_gib"])
        assert run["max_actor_rss_gib"] == max(run["actor_rss_gib"])
        assert positive(run["s"], run["driver_rss_gib"])
    assert set(out["preflight_driver_rss_gib"]) == {"8"}
    assert positive(out["preflight_driver_rss_gib"]["8"])
