"""workload.optimizer: torchao's low-bit AdamW in the built-in recipes
(actors/capture/workloads/optimizers.py), captured on fake with its compiled step."""
from __future__ import annotations

import pytest

from actors.capture.fake_rank import record_meta_rank
from actors.capture.request import CaptureRequest
from actors.capture.workloads.build import build_workload
from actors.capture.workloads.config import WorkloadConfig
from actors.errors import ConfigError
from actors.trace import load_trace
from actors.trace.liveness import compute_liveness

D_MODEL, VOCAB, WORLD = 128, 256, 2


def _held_bytes(tmp_path, optimizer: str) -> int:
    """Bytes rank 0's fake capture (FSDP2 over 2) holds from before its iteration: the
    parameters' shards, the optimizer state, the rotary tables."""
    cfg = WorkloadConfig(model="llama", parallel="fsdp2", precision="bf16_mixed", vocab=VOCAB,
                         d_model=D_MODEL, n_layers=1, n_heads=4, ffn_dim=4 * D_MODEL,
                         seq_len=16, batch_size=1, device="fake", optimizer=optimizer)
    out = tmp_path / optimizer
    out.mkdir()
    trace = load_trace(record_meta_rank(CaptureRequest(cfg), str(out), 0, WORLD)[1])
    return compute_liveness(trace.ops, trace.num_storages).external_bytes()


def test_the_8bit_state_is_a_quarter_of_adamws(tmp_path):
    """Every weight of this model (nine matrices) has a shard of >= 4096 elements, a multiple
    of torchao's 256-element block: its two moments are 1 byte per element plus a float32
    scale per block and torchao's 256-entry float32 code book, against AdamW's 4 + 4 bytes;
    the norms' moments stay float32 in both. The state is read only by the compiled update's
    generated kernels: it reaches the trace through the reads
    actors/capture/fake/compiled_on_fake.py records."""
    adamw, low_bit = _held_bytes(tmp_path, "adamw"), _held_bytes(tmp_path, "adamw_8bit")
    weights = (2 * D_MODEL * VOCAB + 4 * D_MODEL ** 2 + 3 * D_MODEL * 4 * D_MODEL) // WORLD
    quantized = 2 * (weights + weights // 256 * 4 + 9 * 256 * 4)
    assert abs((adamw - low_bit) - (8 * weights - quantized)) <= 0.02 * quantized, \
        (adamw, low_bit, 8 * weights, quantized)


@pytest.mark.parametrize("workload,message", [
    (dict(device="meta"), "needs fake, cpu or cuda tensors"),
    (dict(parallel="zero3", precision="bf16_mixed"), "zero3 steps DeepSpeed's optimizer"),
    (dict(model="custom", entrypoint="examples/ddp_step.py:build"), "a custom step its own")])
def test_a_low_bit_optimizer_is_refused_where_torchao_cannot_step(workload, message):
    with pytest.raises(ConfigError, match=rf"workload.optimizer=adamw_4bit .*{message}"):
        build_workload(WorkloadConfig(optimizer="adamw_4bit", **workload), 0, 1)


def test_an_unknown_optimizer_is_refused():
    with pytest.raises(ConfigError, match="workload.optimizer='lion'; expected one of adamw, "
                                          "adamw_8bit, adamw_4bit"):
        WorkloadConfig(optimizer="lion")
