"""FSDP1 (FullyShardedDataParallel, flat parameters) on fake, as it really holds memory: the
unsharded flat parameter and the low-precision shard are re-allocated in place (storage
resizes, no op) around each all-gather, which the trace's generations follow
(actors/trace/tensor_ids.py). Measured against real runs in scripts/bench_predict.py
(fsdp1_* rows)."""
from __future__ import annotations

from pathlib import Path

import pytest

from actors.replay.config import AllocationConfig, ReplayConfig
from actors.replay.session import replay_rank
from actors.trace import load_trace
from tests.support.fake_vs_real import capture_fake

REPO = Path(__file__).resolve().parents[2]
STEP = f"{REPO / 'examples' / 'fsdp1_llama_step.py'}:build"
DIM, LAYERS = 64, 2


def _capture(tmp_path, monkeypatch, strategy: str):
    monkeypatch.setenv("EXAMPLE_STRATEGY", strategy)
    monkeypatch.setenv("EXAMPLE_DIM", str(DIM))
    monkeypatch.setenv("EXAMPLE_LAYERS", str(LAYERS))
    return capture_fake(STEP, tmp_path / strategy, world_size=2)


def _peak(path) -> dict:
    report = replay_rank(path, ReplayConfig(mode="compute", device="meta", iters=1,
                                            warmup_iters=1, measure_memory=False,
                                            allocation=AllocationConfig(mode="faithful")))
    assert report["status"] == "ok", report["error"]
    return report


def _gathers(trace):
    return [op for op in trace.ops if op.collective is not None
            and op.collective.kind == "all_gather"]


def test_full_shard_regathers_into_a_new_generation_and_frees_after_forward(tmp_path,
                                                                             monkeypatch):
    full = _capture(tmp_path, monkeypatch, "FULL_SHARD")
    grad_op = _capture(tmp_path, monkeypatch, "SHARD_GRAD_OP")
    trace = load_trace(full)
    by_storage, block_bytes = {}, set()
    for op in _gathers(trace):
        (out,) = {t.storage_id for t in op.output_tensors()}
        by_storage.setdefault(out, []).append({t.suid for t in op.output_tensors()})
        if len(by_storage[out]) == 2:
            block_bytes.add(op.collective.out_nelems * 2)  # a block's unit, in bf16
    # each block is gathered in forward and again in backward, into the same storage: two
    # lives of it, not one held from the first gather to the last read (the root unit is not
    # resharded after forward)
    regathered = [lives for lives in by_storage.values() if len(lives) == 2]
    assert len(regathered) == LAYERS and all(a != b for a, b in regathered)
    # what FULL_SHARD frees after each block's forward is held at the peak by SHARD_GRAD_OP
    # (the loss's backward, every block's forward done): the blocks' gathered bf16 bytes
    (block,) = block_bytes
    full_report, grad_op_report = _peak(full), _peak(grad_op)
    held = grad_op_report["accounted_peak_bytes"] - full_report["accounted_peak_bytes"]
    assert held == pytest.approx(LAYERS * block, rel=0.01)
    # the low-precision shards are made and freed around each gather: nothing of FSDP1's is
    # held from before the iteration but the parameters, gradients and optimizer state
    assert full_report["peak_breakdown"]["buffers"] < 16 << 10


def test_no_shard_makes_its_low_precision_parameters_in_the_iteration(tmp_path, monkeypatch):
    """With nothing to gather (NO_SHARD, or HYBRID_SHARD's shard group of one rank) FSDP1 casts
    each unit's parameters into its low-precision flat parameter (a copy_ into the whole
    re-allocated storage) before the forward and again before the backward, freeing it in
    between: not held from before the iteration (it was: 1.0667 on bench_predict's
    fsdp1_hybrid_shard row at 2 ranks)."""
    path = _capture(tmp_path, monkeypatch, "NO_SHARD")
    assert not _gathers(load_trace(path))
    report = _peak(path)
    assert report["peak_breakdown"]["buffers"] < 16 << 10
