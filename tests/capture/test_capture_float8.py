"""workload.float8: torchao's float8 linears with FSDP2's float8 all-gathers, captured on fake
and dry-run on meta; the other recipes (bf16 all-gathers, rowwise scales) captured; the
combinations it cannot run refused."""
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


def _capture(folder, **fields):
    run_capture_job(CaptureConfig(workload=WorkloadConfig(**TINY, float8=True, **fields),
                                  world_size=2, out_dir=str(folder)))
    return load_trace(folder / trace_file_name(0))


def _gathers(trace) -> list:
    return [op.collective for op in trace.collectives
            if op.collective.kind == "all_gather_into_tensor"]


@pytest.fixture(scope="module")
def tensorwise(tmp_path_factory):
    """The default recipe's trace: tensorwise scales, float8 all-gathers."""
    return _capture(tmp_path_factory.mktemp("tensorwise"))


def test_float8_linears_and_all_gathers_on_fake(tensorwise):
    trace = tensorwise
    names = Counter(op.name for op in trace.ops)
    # 7 Linears per block, a forward and two backward matmuls each; the output stays bf16
    assert names["aten::_scaled_mm"] == 2 * 7 * 3
    gathers = _gathers(trace)
    # the root's (embedding, norms, output) in bf16; each block's weights in float8 bytes
    assert [c.dtype for c in gathers] == ["bfloat16", "uint8", "uint8", "uint8"]
    assert gathers[1].in_nelems == gathers[2].in_nelems
    engine = ReplayEngine(trace, ReplayConfig(mode="compute", device="meta", iters=1,
                                              warmup_iters=1, measure_memory=False,
                                              allocation=AllocationConfig(mode="faithful")))
    report = engine.run().to_dict()
    assert report["status"] == "ok" and report["coverage"] == 1.0


@pytest.mark.parametrize("fields, num_scaled_mm, scale_shape", [
    ({"float8_all_gather": False}, 2 * 7 * 3, ()),
    # the weight gradient in high precision: two float8 matmuls per Linear, and a bf16 mm
    ({"float8_recipe": "rowwise_with_gw_hp"}, 2 * 7 * 2, (2 * 32, 1)),
], ids=["tensorwise_bf16_gathers", "rowwise_with_gw_hp"])
def test_bf16_all_gathers_and_each_recipes_scales(tmp_path, tensorwise, fields, num_scaled_mm,
                                                   scale_shape):
    trace = _capture(tmp_path, **fields)
    scaled = [op for op in trace.ops if op.name == "aten::_scaled_mm"]
    assert len(scaled) == num_scaled_mm
    assert scaled[0].inputs[2].shape == scale_shape  # the input's scale: one, or one a row
    gathers, float8_gathers = _gathers(trace), _gathers(tensorwise)
    assert [c.dtype for c in gathers] == ["bfloat16"] * 4
    # the same elements, each weight's in 2 bytes, not 1: float8's gather of uint8 bytes is
    # larger than bf16's element count by the block's two bf16 RMSNorm weights (64 each) only
    assert [f.in_nelems - g.in_nelems for f, g in zip(float8_gathers[1:], gathers[1:])] == \
        [2 * 64 // 2] * 3


def test_a_float8_gather_with_a_rowwise_recipe_is_refused():
    with pytest.raises(ConfigError, match="tensorwise scales only"):
        validate(WorkloadConfig(**TINY, float8=True, float8_recipe="rowwise",
                                float8_all_gather=True))
    validate(WorkloadConfig(**TINY, float8=True, float8_recipe="rowwise"))  # bf16 gathers
    with pytest.raises(ConfigError, match="workload.float8_recipe='blockwise'; expected one of"):
        WorkloadConfig(**TINY, float8=True, float8_recipe="blockwise")


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
