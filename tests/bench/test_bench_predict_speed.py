"""The smoke test of scripts/bench_predict_speed.py (tests/support/bench.py)."""
from __future__ import annotations

import pytest

from tests.support.bench import SLOW_TIMEOUT_S, positive, run_bench

pytestmark = pytest.mark.long  # CI's second job (scripts/test.sh --long)


@pytest.mark.slow
@pytest.mark.timeout(SLOW_TIMEOUT_S)
def test_bench_predict_speed():
    # The Ray dry run and the fit search are other scripts' parts, run whole by their own smoke
    # tests (bench_dry_run_scale's; bench_fit_search's, which checks the key read here): skipped,
    # their figures are null, and so are their targets' verdicts.
    out = run_bench("predict_speed", "--skip", "dry_run", "fit_search", "--pp8")
    skipped = ("dry_run_1024_s", "driver_rss_1024_gib", "dry_run_num_ranks", "fit_search_70b_s")
    assert out["quick"] is True
    assert positive(out["predict_8b_cold_s"], out["predict_8b_cached_s"],
                     out["predict_70b_cold_s"], out["meta_us_per_op_70b"],
                     out["predict_8b_cached_rss_gib"], out["predicted_reserved_8b_bytes"],
                     out["predict_405b_cold_s"],  # the 405B TP 8 x FSDP2 preset, cut to 2 layers
                     out["predict_405b_pp8_cold_s"], out["predict_405b_pp8_cold_rss_gib"])
    assert out["predict_405b_pp8_timings_s"]["capture_s"] > 0 and out["load_avg_1m"] >= 0
    assert out["predict_405b_pp8_verdict"] in ("fits", "too_close", "oom")
    by_role = out["predict_405b_pp8_reserved_gib_by_role"]
    assert sorted(by_role) == [f"pp stage {i}" for i in range(8)] and positive(*by_role.values())
    # the cached run reused the capture: no capture time in its own timings
    assert out["predict_8b_timings_s"]["cached"]["capture_s"] < 1
    assert out["predict_8b_timings_s"]["cold"]["capture_s"] > 0
    assert all(out[key] is None for key in skipped)
    assert all(met is None if key in skipped else isinstance(met, bool)
               for key, met in out["targets_met"].items())
