"""The smoke test of scripts/bench_predict.py (tests/support/bench.py)."""
from __future__ import annotations

import pytest

from tests.support.bench import SLOW_TIMEOUT_S, positive, run_bench

pytestmark = pytest.mark.long  # CI's second job (scripts/test.sh --long)


@pytest.mark.slow
@pytest.mark.timeout(SLOW_TIMEOUT_S)
def test_bench_predict():
    from scripts.bench_predict import QUICK_CONFIGS

    out = run_bench("predict")
    assert list(out["configs"]) == QUICK_CONFIGS
    for row in out["configs"].values():
        assert positive(row["predicted"], row["measured"], row["ratio"], row["world_size"])
    assert out["configs"]["fsdp2_tp_sp_bf16_mixed"]["world_size"] == 4
    tracked = out["configs"]["nn_transformer_encoder_fsdp2_checkpoint"]["fsdp_mem_tracker_ratio"]
    assert positive(tracked)
    assert isinstance(out["max_abs_error"], (int, float)) and out["max_abs_error"] >= 0
