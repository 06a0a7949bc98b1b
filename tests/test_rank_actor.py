"""The rank actor's own behaviour, driven in-process (no Ray): its report on early failures."""
from __future__ import annotations

from pathlib import Path

import pytest

from actors.rank_actor import RankActor
from actors.replay.config import AllocationConfig, ReplayConfig
from actors.zero3.config import Zero3Config

DEMO = Path(__file__).resolve().parents[1] / "demo" / "traces" / "gpt_dp_4"


@pytest.fixture
def actor(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    a = RankActor()
    monkeypatch.setattr(a, "_where", lambda: {"node_ip": "127.0.0.1", "node_id": "node"})
    return a


def test_shards_that_do_not_fit_are_an_oom_not_a_failure(actor):
    """ZeRO-3 charges every shard before the first op: a device too small for them is an OOM."""
    cfg = ReplayConfig(mode="compute", device="cpu", iters=1, warmup_iters=0,
                       device_memory_capacity="16KiB", allocation=AllocationConfig(mode="lazy"))
    report = actor.replay(str(DEMO / "rank-0.et.json.gz"), None, cfg, [],
                          zero3=Zero3Config(strategy="per_module", param_persistence_threshold=0))
    assert report["status"] == "oom", report["error"]
    assert "out of memory before the first op" in report["error"]
    assert report["oom"]["requested_bytes"] > 16 * 1024 - report["oom"]["held_bytes"]
    assert report.get("traceback") is None
