"""The run's ``zero3`` summary is ZeRO-3's own aggregation, reached by the driver's loop over
the rank-side extensions: sizes as the largest rank's, times as the median and slowest rank's,
every per-rank figure of ``Zero3Metrics.summary()`` (no second key list to keep in step)."""
from __future__ import annotations

from actors.zero3.metrics import Zero3Metrics
from orchestrator.run.aggregate import extension_summaries


def _part(wait_s: float, shard_bytes: int) -> dict:
    figures = {k: 1 for k in Zero3Metrics().summary()}
    figures.update(wait_s=wait_s, shard_bytes=shard_bytes, modules=["blocks.0"])
    return {"strategy": "per_module", "world_size": 3, **figures}


def test_the_driver_loops_over_the_rank_extensions():
    reports = [{"rank": r, "zero3": _part(w, s)} for r, (w, s) in enumerate(
        [(1.0, 10), (3.0, 30), (2.0, 20)])] + [{"rank": 3, "status": "failed"}]
    z = extension_summaries(reports)["zero3"]
    assert z["strategy"] == "per_module" and z["world_size"] == 3
    assert z["shard_bytes"] == 30  # the largest rank's
    assert z["wait_s"] == 2.0 and z["wait_max_s"] == 3.0  # the median and the slowest rank's
    keys = list(Zero3Metrics().summary())
    sizes = [k for k in keys if not k.endswith("_s")]
    assert [k for k in z if k in keys] == sizes + [k for k in keys if k.endswith("_s")]
    assert z["modules"] == ["blocks.0"]
    assert extension_summaries([{"rank": 0}]) == {"zero3": None}
