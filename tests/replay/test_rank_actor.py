"""The rank actor's own behaviour, driven in-process (no Ray): its report on early failures."""
from __future__ import annotations

import pytest

from actors.rank_actor import RankActor, ReplayRequest
from actors.replay.config import AllocationConfig, ReplayConfig
from actors.zero3.config import Zero3Config
from orchestrator.config import DEMO_TRACES
from tests.support.trace_factory import et_tail

DEMO = DEMO_TRACES / "gpt_dp_4"


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
    report = actor.replay(ReplayRequest(str(DEMO / "rank-0.et.json.gz"), None, cfg, [],
                          zero3=Zero3Config(strategy="per_module", param_persistence_threshold=0)))
    assert report["status"] == "oom", report["error"]
    assert "out of memory before the first op" in report["error"]
    assert report["oom"]["requested_bytes"] > 16 * 1024 - report["oom"]["held_bytes"]
    assert report.get("traceback") is None


# A user's model: Embedding + LSTM under DDP, recorded by the plain ExecutionTraceObserver
# (no tracefleet-capture, so no module ranges), on 2 gloo ranks.
_LSTM_CAPTURE = r'''
import os, sys
from datetime import timedelta
import torch, torch.distributed as dist, torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ExecutionTraceObserver

rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                        world_size=world, timeout=timedelta(seconds=60))
torch.manual_seed(0)

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.lstm, self.head = nn.Embedding(40, 8), nn.LSTM(8, 8, batch_first=True), \
            nn.Linear(8, 40)
    def forward(self, x):
        return self.head(self.lstm(self.emb(x))[0])

model = DDP(Net())
opt = torch.optim.SGD(model.parameters(), lr=0.1)

def step():
    x = torch.randint(0, 40, (2, 5))
    nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
    opt.step()
    opt.zero_grad()
''' + et_tail()
DRY_RUN = dict(mode="compute", device="meta", iters=1, warmup_iters=0)


@pytest.fixture(scope="module")
def lstm_dir(tmp_path_factory):
    from tests.support.trace_factory import run_rank_script
    return run_rank_script(_LSTM_CAPTURE, tmp_path_factory.mktemp("lstm"), 2, "lstm capture")


@pytest.mark.parametrize("strategy", ["per_param", "per_module", "bucketed", "leaf_coalesced"])
def test_every_zero3_strategy_replays_a_trace_without_module_ranges(actor, lstm_dir, strategy):
    """The user's repro: world 64, nothing persistent, dry run; leaf_coalesced used to fail
    with KeyError('') (the module tree had no root)."""
    zero3 = Zero3Config(strategy=strategy, world_size=64, param_persistence_threshold=0)
    for rank in (0, 1):
        report = actor.replay(ReplayRequest(str(lstm_dir / f"rank-{rank}.json"), None, ReplayConfig(**DRY_RUN),
                              [], zero3=zero3))
        assert report["status"] == "ok", report["error"]
        z = report["zero3"]
        assert z["num_partitioned"] == z["num_params"] > 0  # every parameter partitioned...
        assert z["num_allgathers_per_iteration"] > 0  # ... and fetched


def test_leaf_patterns_on_a_trace_without_ranges_point_to_zero3_modules(actor, lstm_dir):
    zero3 = Zero3Config(strategy="leaf_coalesced", leaf_modules=["lstm"])
    report = actor.replay(ReplayRequest(str(lstm_dir / "rank-0.json"), None, ReplayConfig(**DRY_RUN), [],
                          zero3=zero3))
    assert report["status"] == "failed"
    assert "ConfigError" in report["error"] and "zero3.modules" in report["error"]
    assert "has no module ranges" in report["error"] and "(phase compile)" in report["error"]


def test_an_empty_exception_is_reported_with_its_type_and_phase(actor, monkeypatch):
    """``KeyError('')`` printed as ``''`` told the user nothing: the report and the run's
    error name the type, the phase and the code that raised."""
    from orchestrator.run.aggregate import aggregate

    def broken(*_):
        raise KeyError("")
    monkeypatch.setattr("actors.rank_actor.zero3_extensions", broken)
    report = actor.replay(ReplayRequest(str(DEMO / "rank-0.et.json.gz"), None, ReplayConfig(**DRY_RUN), []))
    assert report["status"] == "failed" and report["phase"] == "compile"
    assert report["error"].startswith("rank 0: KeyError: '' (phase compile) [")
    assert "test_rank_actor.py" in report["error"] and "in broken" in report["error"]
    run_error = aggregate([report], world_size=1)["error"]
    assert "rank 0 failed: KeyError: '' (phase compile)" in run_error


def test_an_empty_exception_in_an_iteration_names_the_node(actor):
    """A failure inside the op loop (here an extension's hook) names the node it stopped at."""
    import torch

    from actors.replay.engine import ReplayEngine
    from actors.replay.extension_contract import ReplayExtension
    from actors.trace import load_trace

    class Broken(ReplayExtension):
        def hooks(self):
            def boom():
                raise RuntimeError()
            return {3: [boom]}, {}

    trace = load_trace(DEMO / "rank-0.et.json.gz")
    report = ReplayEngine(trace, ReplayConfig(**DRY_RUN), device=torch.device("meta"),
                          extensions=[Broken()]).run().to_dict()
    op = trace.ops[3]
    assert report["status"] == "failed"
    assert report["error"].startswith(f"rank 0: RuntimeError: (no message) at node {op.node_id} "
                                      f"{op.name} (phase iteration) [")
