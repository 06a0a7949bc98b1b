"""The replay's one extension seam (actors/replay/extension_contract.py, extension_list.py,
program.py): every extension is built in one place and order, joins the loop through the same hooks, and
collectives run as an extension (``runs``) rather than through a branch in the op loop."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from actors.errors import ReplayError
from actors.replay.comm import extension as comm_extension
from actors.replay.comm.bandwidth import CommStats
from actors.replay.config import AllocationConfig, ReplayConfig
from actors.replay.engine import ReplayEngine
from actors.replay.extension_contract import ReplayExtension
from actors.replay.extension_list import build_extensions
from actors.replay.memory.target import TargetConfig
from actors.trace import load_trace
from actors.zero3.config import Zero3Config
from actors.zero3.extension import zero3_extensions
from orchestrator.config import DEMO_TRACES

DEMO = DEMO_TRACES / "gpt_dp_4" / "rank-0.et.json.gz"


@pytest.fixture(scope="module")
def trace():
    return load_trace(DEMO)


def _cfg(mode="compute", **kw):
    return ReplayConfig(**{"mode": mode, "device": "meta", "iters": 2, "warmup_iters": 1,
                           "measure_memory": False, **kw})


class FakeComm:
    """A CollectiveReplayer without process groups: records the ops it is asked to replay
    and spends no time; each call counts 1 ms of blocked time."""

    def __init__(self):
        self.ran, self.waits, self.blocked_s = [], 0, 0.0
        self.stats = CommStats()

    def run(self, op, get):
        self.ran.append(op.index)
        self.blocked_s += 0.001

    def hooks(self):
        return {}

    def wait_all(self):
        self.waits += 1

    def stats_dict(self):
        return {"fake": {"num_calls": len(self.ran)}}


class _Probe(ReplayExtension):
    name = "probe"

    def __init__(self):
        self.policy_at = {}

    def attach(self, ctx):
        self.ctx = ctx
        self.policy_at["attach"] = ctx.policy

    def hooks(self):
        self.policy_at["hooks"] = self.ctx.policy
        return {}, {}


def test_extensions_are_built_in_one_place_and_order(trace):
    cfg = _cfg("comms", device="cpu", allocation=AllocationConfig(mode="faithful"))
    probe = _Probe()
    zero3 = zero3_extensions(Zero3Config(strategy="per_module", world_size=4), trace)
    exts = build_extensions(trace, cfg, torch.device("cpu"), FakeComm(), [probe, *zero3],
                            TargetConfig(name="h100_80gb"))
    names = [e.name for e in exts]
    # the meter measures what the others allocate, the allocator model sees what they
    # charge, the collectives complete after a host gap at the same op
    assert names[:4] == ["memory_measure", "cuda_allocator", "probe", "zero3"]
    assert names[-1] == "collectives" and names.count("collectives") == 1


def test_a_mode_with_collectives_needs_process_groups(trace):
    with pytest.raises(ReplayError, match="replay.mode=comms needs process groups"):
        build_extensions(trace, _cfg("comms", device="cpu"), torch.device("cpu"))


def test_collectives_run_through_the_extension_and_time_as_communication(trace, monkeypatch):
    monkeypatch.setattr(comm_extension, "world_max", lambda device: None)  # no world here
    comm = FakeComm()
    engine = ReplayEngine(trace, _cfg("comms", device="cpu"), comm=comm)
    r = engine.run().to_dict()
    assert r["status"] == "ok", r["error"]
    collectives = [op.index for op in trace.ops if op.collective is not None]
    assert collectives and comm.ran == collectives * 3  # warm-up and two timed iterations
    assert r["collectives"] == {"fake": {"num_calls": 3 * len(collectives)}}
    assert comm.waits >= 3  # every iteration settles its async collectives
    # the iteration's communication time is what the extension was blocked
    assert r["comm_time_s"] == pytest.approx(0.001 * len(collectives))


def test_the_policy_is_in_the_context_when_hooks_are_planned(trace):
    probe = _Probe()
    engine = ReplayEngine(trace, _cfg(), extensions=[probe])
    assert probe.policy_at["attach"] is None  # owned storages are not known yet
    assert probe.policy_at["hooks"] is engine.policy
    assert probe.ctx.store is engine.store and probe.ctx.memory is engine.memory


def test_the_memory_meter_is_an_extension_with_the_report_keys_it_had(trace):
    engine = ReplayEngine(trace, _cfg(measure_memory=True, device="cpu"))
    r = engine.run().to_dict()
    engine.close()
    meter = engine.extensions[0]
    assert meter.name == "memory_measure"
    assert r["memory_measure"] == meter.meter.details()
    assert r["measured_peak_bytes"] == meter.meter.peak_bytes is not None
    assert r["peak_memory_source"] == "measured"
    keys = list(r)
    # the extension's figures keep their place among the engine's
    assert keys.index("measured_peak_bytes") < keys.index("accounted_peak_bytes") < \
        keys.index("memory_measure_method") < keys.index("memory_measure") < \
        keys.index("collectives")
