"""Minimum-memory search: bisection alone, then on a trace whose answer is known by hand."""
from __future__ import annotations

import math

import pandas as pd
import pytest

from actors.errors import ConfigError
from actors.replay.engine import ReplayEngine
from actors.trace import load_trace
from actors.replay.config import AllocationConfig, ReplayConfig
from orchestrator.config import ExperimentConfig, RunConfig, TraceConfig
from orchestrator.studies.min_memory import bisect, combos, search
from orchestrator.study_config import MinMemoryConfig
from orchestrator.outputs import RESULTS_CSV
from tests.support.chain_trace import N, capture_chain


@pytest.mark.parametrize("answer", [1, 777, 123_457, 999_999])
def test_bisection_converges_within_tolerance(answer):
    probed = []

    def fits(c):
        probed.append(c)
        return c >= answer

    result = bisect(fits, 0, 1_000_000, tolerance=0.0, tolerance_bytes=1, max_steps=64)
    assert result.min_ok == answer and result.max_fail == answer - 1
    assert len(probed) <= math.ceil(math.log2(1_000_000)) + 1
    coarse = bisect(lambda c: c >= answer, 0, 1_000_000, tolerance=0.01, tolerance_bytes=1,
                    max_steps=64)
    assert coarse.max_fail < answer <= coarse.min_ok
    assert coarse.min_ok - coarse.max_fail <= max(0.01 * coarse.min_ok, 1)


def test_bisection_stops_at_max_steps():
    result = bisect(lambda c: c >= 5, 0, 1 << 40, 0.0, 1, max_steps=3)
    assert len(result.steps) == 3 and result.min_ok - result.max_fail > 1


@pytest.fixture(scope="module")
def chain_trace(tmp_path_factory):
    return capture_chain(tmp_path_factory.mktemp("chain") / "rank-0.et.json")


def _cfg(trace_dir, modes, **mm):
    mm.setdefault("tolerance", 0.0)
    mm.setdefault("tolerance_bytes", 1)
    return RunConfig(trace=TraceConfig(dir=str(trace_dir)),
                     replay=ReplayConfig(mode="compute", device="meta", iters=1, warmup_iters=0,
                                         allocation=AllocationConfig(mode="lazy")),
                     experiment=ExperimentConfig(search="min_memory",
                                                 min_memory=MinMemoryConfig(allocation_modes=modes, **mm)))


def _in_process(trace_path):
    """A probe that replays in this process (the engine the rank actors run)."""
    trace = load_trace(trace_path)
    calls = []

    def replay(cfg, out_dir):
        calls.append(cfg.replay.device_memory_capacity)
        return ReplayEngine(trace, cfg.replay).run().to_dict()
    return replay, calls


def test_min_memory_finds_the_hand_computed_capacity(chain_trace, tmp_path):
    replay, calls = _in_process(chain_trace)
    summary = search(_cfg(chain_trace.parent, ["lazy", "faithful", "pre_allocate"]), tmp_path, replay)
    assert summary["status"] == "ok", summary["error"]
    found = {a["replay.allocation.mode"]: a for a in summary["searches"]}
    assert found["lazy"]["min_capacity_bytes"] == 3 * 4 * N
    assert found["faithful"]["min_capacity_bytes"] == 3 * 4 * N
    pre = found["pre_allocate"]
    assert pre["min_capacity_bytes"] == 4 * 4 * N and pre["max_failing_capacity_bytes"] == 4 * 4 * N - 1
    # without flushing a replay fits iff its peak does: lazy and faithful peak at the bound
    # (the reference settles it); for pre_allocate a replay at its peak minus 1 B fails
    assert found["lazy"]["num_steps"] == found["faithful"]["num_steps"] == 1
    assert pre["num_steps"] == 2
    assert pre["accounted_peak_bytes"] == 4 * 4 * N  # the answer row: the reference's figures
    assert len(calls) == sum(a["num_steps"] for a in summary["searches"])
    table = pd.read_csv(tmp_path / RESULTS_CSV)
    assert set(table["kind"]) == {"probe", "min_memory"}
    probes = table[(table["kind"] == "probe") & (table["replay.allocation.mode"] == "pre_allocate")]
    assert set(probes["status"]) == {"ok", "oom"}
    assert len(probes) == pre["num_steps"]


def test_min_memory_with_a_tolerance_brackets_the_answer(chain_trace, tmp_path):
    replay, _ = _in_process(chain_trace)
    summary = search(_cfg(chain_trace.parent, ["pre_allocate"], tolerance=0.1, tolerance_bytes=1),
                     tmp_path, replay)
    (answer,) = summary["searches"]
    assert answer["max_failing_capacity_bytes"] < 4 * 4 * N <= answer["min_capacity_bytes"]
    assert answer["min_capacity_bytes"] - answer["max_failing_capacity_bytes"] <= answer["tolerance_bytes"]


def test_a_replay_that_never_completes_is_a_failed_search(chain_trace, tmp_path):
    def broken(cfg, out_dir):
        return {"status": "failed", "error": "rank 0 failed at node 5"}
    summary = search(_cfg(chain_trace.parent, ["lazy"]), tmp_path, broken)
    assert summary["status"] == "failed"
    assert "lazy" in summary["error"] and "rank 0 failed at node 5" in summary["error"]


def test_search_axes_and_bad_settings():
    cfg = _cfg("/x", ["pre_allocate", "lazy"])
    cfg.experiment.min_memory.thresholds = [1.0, 0.5]
    # pre_allocate never flushes: searched at threshold 1.0 only
    assert combos(cfg) == [("pre_allocate", 1.0), ("lazy", 1.0), ("lazy", 0.5)]
    with pytest.raises(ConfigError, match="thresholds"):
        MinMemoryConfig(thresholds=[1.5]).validate()
    with pytest.raises(ConfigError, match="tolerance"):
        MinMemoryConfig(tolerance=1.0).validate()


def test_min_memory_with_flushing_bisects_from_zero(chain_trace, tmp_path):
    """With a threshold below 1 flushing may go under the liveness bound, so the search does
    not stop there; the floor is still the add's own working set: x, y and z, 12288 B."""
    replay, calls = _in_process(chain_trace)
    cfg = _cfg(chain_trace.parent, ["lazy"], thresholds=[0.5])
    summary = search(cfg, tmp_path, replay)
    (answer,) = summary["searches"]
    assert answer["replay.allocation.device_memory_threshold"] == 0.5
    assert answer["min_capacity_bytes"] == 3 * 4 * N and answer["max_failing_capacity_bytes"] == 3 * 4 * N - 1
    assert answer["num_steps"] > 10  # bisected over (0, 12288], not stopped at the bound
