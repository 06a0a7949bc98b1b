"""The smoke test of scripts/bench_dry_run_scale.py (tests/support/bench.py)."""
from __future__ import annotations

import pytest

from tests.support.bench import SLOW_TIMEOUT_S, positive, run_bench

pytestmark = pytest.mark.long  # CI's second job (scripts/test.sh --long)


@pytest.mark.slow
@pytest.mark.timeout(SLOW_TIMEOUT_S)
def test_bench_dry_run_scale():
    out = run_bench("dry_run_scale")
    assert out["quick"] and out["workload"] == "llama_8b" and out["world_size"] == 8
    assert out["num_replays"] == 1  # rank 0 hard-linked for every rank: one replay
    assert positive(out["capture_s"], out["dry_run_s"], out["driver_rss_gib"])
    assert out["timings_s"]["replay_s"] >= 0
    compare = out["compare"]
    assert compare["num_ranks"] == 2 and positive(compare["dedup_s"], compare["every_rank_s"])
