"""The smoke test of scripts/bench_distributed.py (tests/support/bench.py)."""
from __future__ import annotations

import pytest

from tests.support.bench import SLOW_TIMEOUT_S, positive, run_bench

pytestmark = pytest.mark.long  # CI's second job (scripts/test.sh --long)


@pytest.mark.slow
@pytest.mark.timeout(SLOW_TIMEOUT_S)
def test_bench_distributed():
    out = run_bench("distributed")
    assert out["quick"] and out["e2e_4"]["world_size"] == 4
    assert out["e2e_8"]["world_size"] == 2 and positive(out["capture_8_s"])  # quick: 2 ranks
    for e2e in (out["e2e_4"], out["e2e_8"]):
        assert positive(e2e["replay_s"], e2e["total_s"], e2e["iteration_time_s"],
                         e2e["actors_start_rendezvous_s"])
    comms = out["comms"]
    assert comms["world_size"] == 2 and comms["sizes_mib"] == [1]
    assert all(positive(k["replay_busbw_gbps"], k["raw_busbw_gbps"], k["ratio"])
               for k in comms["kinds"].values())
