"""workload.float8: torchao's float8 linears with FSDP2's float8 all-gathers, captured on fake
and dry-run on meta; the combinations it cannot run refused."""
from __future__ import annotations

from collections import Counter

import pytest

from actors.capture.workloads.mesh import validate_parallelism
from actors.capture.workloads.config import WorkloadConfig, validate
from actors.errors import ConfigError
from actors.replay.config import AllocationConfig, ReplayConfig
from actors.replay.engine import ReplayEngine
from actors.trace import load_trace
from actors.trace.conventions import trace_file_name
from orchestrator.run.capture import CaptureConfig, run_capture_job

pytest.importorskip("torchao.float8")

TINY = dict(model="llama", parallel="fsdp2", precision="bf16_mixed", device="fake", vocab=64,
            d_model=64, n_layers=2, n_heads=4, seq_len=32, batch_size=2)


def test_float8_linears_and_all_gathers_on_fake(tmp_path):
    run_capture_job(CaptureConfig(workload=WorkloadConfig(**TINY, float8=True), world_size=2,
                                  out_dir=str(tmp_path)))
    trace = load_trace(tmp_path / trace_file_name(0))
    names = Counter(op.name for op in trace.ops)
    # 7 Linears per block, a forward and two backward matmuls each; the output stays bf16
    assert names["aten::_scaled_mm"] == 2 * 7 * 3
    gathers = [op.collective for op in trace.collectives
               if op.collective.kind == "all_gather_into_tensor"]
    # the root's (embedding, norms, output) in bf16; each block's weights in float8 bytes
    assert [c.dtype for c in gathers] == ["bfloat16", "uint8", "uint8", "uint8"]
    assert gathers[1].in_nelems == gathers[2].in_nelems
    engine = ReplayEngine(trace, ReplayConfig(mode="compute", device="meta", iters=1,
                                              warmup_iters=1, measure_memory=False,
                                              allocation=AllocationConfig(mode="faithful")))
    report = engine.run().to_dict()
    assert report["status"] == "ok" and report["coverage"] == 1.0


@pytest.mark.parametrize("fields, message", [
    ({"parallel": "ddp"}, "float8 training is torchtitan's bf16_mixed FSDP2 recipe"),
    ({"device": "cpu"}, "no cpu kernel"),
])
def test_float8_outside_its_recipe_is_refused(fields, message):
    with pytest.raises(ConfigError, match=message):
        validate(WorkloadConfig(**{**TINY, **fields}, float8=True))


def test_float8_with_tensor_parallel_is_refused():
    with pytest.raises(ConfigError, match="float8 parallel styles"):
        validate_parallelism(WorkloadConfig(**TINY, float8=True, parallelism={"tp": 2}), 4)
