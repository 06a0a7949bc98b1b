"""DeepSpeed's own engine (``deepspeed.initialize`` with the user's config) captured on fake at
ZeRO stages 0-2: the engine runs as on cpu (torch's launcher variables set for the rank, its
no-op parameter moves kept in place, its overflow and norm reads answered as for finite
gradients: actors/capture/fake/known_reads.py). Measured against the real engine in
scripts/bench_predict.py (deepspeed_engine_* rows)."""
from __future__ import annotations

from pathlib import Path

import pytest

from actors.replay.config import AllocationConfig, ReplayConfig
from actors.replay.session import replay_rank
from actors.trace import load_trace
from tests.support.fake_vs_real import capture_fake

pytest.importorskip("deepspeed")
REPO = Path(__file__).resolve().parents[2]
STEP = f"{REPO / 'examples' / 'deepspeed_llama_step.py'}:build"
WORLD = 2


def _capture(tmp_path, monkeypatch, stage: int):
    monkeypatch.setenv("EXAMPLE_ZERO_STAGE", str(stage))
    return capture_fake(STEP, tmp_path / f"zero{stage}", world_size=WORLD)


def _optimizer_state(path) -> int:
    report = replay_rank(path, ReplayConfig(mode="compute", device="meta", iters=1,
                                            warmup_iters=1, measure_memory=False,
                                            allocation=AllocationConfig(mode="faithful")))
    assert report["status"] == "ok", report["error"]
    return report["peak_breakdown"]["optimizer_state"]


@pytest.mark.timeout(600)
def test_the_engine_partitions_what_its_stage_says(tmp_path, monkeypatch):
    """Stage 0 keeps AdamW's fp32 masters and moments whole on every rank; stage 1 and 2
    partition them over the world; stage 2 reduce-scatters the gradients where stage 1
    all-reduces them."""
    traces = {stage: _capture(tmp_path, monkeypatch, stage) for stage in (0, 1, 2)}
    kinds = {stage: {op.collective.kind for op in load_trace(path).ops
                     if op.collective is not None} for stage, path in traces.items()}
    assert "reduce_scatter" not in kinds[1] and "all_reduce" in kinds[1]
    assert {"reduce_scatter", "reduce_scatter_tensor"} & kinds[2] or "all_reduce" in kinds[2]
    whole, stage1, stage2 = (_optimizer_state(traces[s]) for s in (0, 1, 2))
    assert stage1 == pytest.approx(whole / WORLD, rel=0.05)
    assert stage2 == pytest.approx(stage1, rel=0.05)


def test_an_unanswered_read_in_the_engine_is_still_refused(tmp_path, monkeypatch):
    """Only the known reads are answered: a step that reads the loss is refused as before.
    The engine started on fake without JIT-building DeepSpeed's shm comm op (a real run's
    all-reduce speed-up; 30-90 s of g++ in a fresh environment): nothing was compiled."""
    from actors.errors import ConfigError

    extensions = tmp_path / "torch_extensions"
    extensions.mkdir()
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(extensions))
    monkeypatch.setenv("EXAMPLE_ZERO_STAGE", "1")
    monkeypatch.setenv("EXAMPLE_READ_LOSS", "1")
    with pytest.raises(ConfigError, match=r"reads a tensor's value .*deepspeed_llama_step.py"):
        capture_fake(STEP, tmp_path / "reads", world_size=WORLD)
    assert not any(extensions.iterdir())
