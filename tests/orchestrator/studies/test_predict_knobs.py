"""tracefleet-predict on the knobs people turn to fit a job (issue 30): a chunked loss holds a
slice of the vocabulary-wide logits, FSDP2's reshard-after-forward policy keeps more or fewer
gathered blocks, and Qwen3's shapes (q/k norms, head_dim, tied embeddings) predict like any
Llama-shaped job. Each is compared with the same job without the knob, in one run."""
from __future__ import annotations

from orchestrator.reports.predict_table import prediction_table
from tests.support.small_predict import predict_small

# a large vocabulary on a small model, so the logits are what moves
TINY = dict(vocab=16384, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=64,
            ffn_dim=256, seq_len=256, batch_size=2, activation_checkpointing="none")


def _predict(cache, *overrides):
    return predict_small(cache, "qwen3_1_7b", TINY, *overrides)


def test_a_chunked_loss_holds_a_slice_of_the_logits(tmp_path):
    whole = _predict(tmp_path)
    chunked = _predict(tmp_path, "workload.loss_chunks=8")
    logits = 2 * 256 * 16384 * 4  # the batch's float32 logits
    saved = whole.predicted_allocated_peak_bytes - chunked.predicted_allocated_peak_bytes
    # at least half the float32 logits are no longer held (their bf16 copy and gradient
    # usually go too); a slice stays
    assert logits / 2 <= saved < 4 * logits
    assert ", loss in 8 chunks" in prediction_table(chunked.to_dict()).splitlines()[0]
    assert "chunks" not in prediction_table(whole.to_dict()).splitlines()[0]


def test_reshard_policy_orders_the_peaks(tmp_path):
    peaks = {policy: _predict(tmp_path, f"workload.reshard_after_forward={policy}",
                              "workload.loss_chunks=8").predicted_allocated_peak_bytes
             for policy in ("always", "default", "never")}
    assert peaks["always"] <= peaks["default"] < peaks["never"]
    # never keeps every block's bf16 parameters gathered through forward: the three blocks
    # default frees (4 blocks, the last kept by both)
    block = 2 * (128 * 4 * 64 + 2 * 128 * 2 * 64 + 4 * 64 * 128 + 2 * 64 + 2 * 128
                 + 3 * 128 * 256)
    assert peaks["never"] - peaks["default"] >= 3 * block * 0.9


def test_two_captures_of_one_job_predict_the_same_bytes(tmp_path):
    """Each capture is fresh (its own cache): the Python numbers the step passes (``x + eps``)
    land wherever malloc puts them, which once decided how many storages the trace seemed to
    have, and moved the peak by a few KiB from one capture to the next."""
    first, second = (_predict(tmp_path / name, "workload.loss_chunks=8")
                     for name in ("first", "second"))
    for key in ("predicted_allocated_peak_bytes", "predicted_reserved_peak_bytes"):
        assert getattr(first, key) == getattr(second, key), key
