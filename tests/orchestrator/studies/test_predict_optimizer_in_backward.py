"""tracefleet-predict with the optimizer step in backward (workload.optimizer_in_backward,
torchtitan's optimizer.early_step_in_backward): each parameter's AdamW step runs in its
post-accumulate-grad hook once FSDP2 has reduced its gradient, which is freed right after.
The bench_predict row measures it for real (fsdp2_optimizer_in_backward_bf16_mixed)."""
from __future__ import annotations

import pytest

from actors.capture.workloads.config import WorkloadConfig, validate
from actors.errors import ConfigError
from orchestrator.reports.predict_table import prediction_table
from tests.support.small_predict import predict_small

# bench_predict's model on a short batch: the plain step's peak is its update, every gradient
# shard held
SHORT = dict(vocab=512, d_model=256, n_layers=4, n_heads=4, n_kv_heads=4, ffn_dim=0,
             seq_len=32, batch_size=1, activation_checkpointing="none")


def test_each_gradient_is_freed_after_its_own_update(tmp_path):
    plain = predict_small(tmp_path, "llama3_8b", SHORT)
    in_backward = predict_small(tmp_path, "llama3_8b", {**SHORT, "optimizer_in_backward": "true"})
    grads, stepped = plain.breakdown["gradients"], in_backward.breakdown["gradients"]
    assert stepped < grads / 4  # a few parameters' gradients at a time, not all of them
    # the update is told apart wherever it runs: its moments stay optimizer state, not buffers
    assert in_backward.breakdown["optimizer_state"] == plain.breakdown["optimizer_state"] > 0
    assert in_backward.predicted_allocated_peak_bytes <= \
        plain.predicted_allocated_peak_bytes - grads / 2
    assert ", optimizer in backward)" in prediction_table(in_backward.to_dict()).splitlines()[0]
    assert "optimizer in backward" not in prediction_table(plain.to_dict()).splitlines()[0]


@pytest.mark.parametrize("fields, named", [
    (dict(parallel="ddp"), "parallel=ddp"),
    (dict(parallel="fsdp2", grad_accum_steps=2), "grad_accum_steps=2"),
    (dict(parallel="fsdp2", parallelism={"pp": 2}), "pp=2"),
])
def test_the_step_in_backward_is_fsdp2s_once_per_step(fields, named):
    with pytest.raises(ConfigError, match=f"optimizer_in_backward=true with .*{named}"):
        validate(WorkloadConfig(model="llama", optimizer_in_backward=True, **fields))
