"""Distributed replay on a local Ray cluster: full and comms modes, failures end fast."""
from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections import Counter
from pathlib import Path

import orjson
import pytest
import ray
import ray.cloudpickle

from actors.errors import ConfigError
from actors.rank_actor import RankActor
from actors.trace import load_trace
from actors.replay.config import AllocationConfig, ReplayConfig
from orchestrator.config import ClusterConfig, ExperimentConfig, RunConfig, TraceConfig
from orchestrator.run.launch import run_replay
from tests.support.trace_factory import capture_ranks
from tests.support.bounds import CLUSTER_START_S, LOAD_MARGIN_S

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ray_session(tmp_path_factory):
    temp = tmp_path_factory.mktemp("ray")
    ray.init(num_cpus=8, include_dashboard=False, _temp_dir=str(temp), log_to_driver=False)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # ship the test actors
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def traces2(tmp_path_factory):
    return capture_ranks(tmp_path_factory.mktemp("tr2"), 2)


@pytest.fixture(scope="module")
def traces4(tmp_path_factory):
    return capture_ranks(tmp_path_factory.mktemp("tr4"), 4)


def _cfg(trace_dir, **replay):
    replay.setdefault("iters", 2)
    alloc = replay.pop("alloc", "pre_allocate")
    return RunConfig(cluster=ClusterConfig(timeout_s=CLUSTER_START_S),
                     trace=TraceConfig(dir=str(trace_dir)),
                     replay=ReplayConfig(allocation=AllocationConfig(mode=alloc),
                                         collective_timeout_s=20, **replay),
                     experiment=ExperimentConfig(replay_timeout_s=120, failure_grace_s=3))


PHASES = ("preflight_s", "cluster_start_s", "actor_start_s", "trace_load_s", "rendezvous_s",
          "replay_s", "teardown_s", "aggregation_s")


def test_two_rank_full_replay_writes_outputs(ray_session, traces2, tmp_path):
    t0 = time.perf_counter()
    summary = run_replay(_cfg(traces2, alloc="lazy"), tmp_path)
    wall_s = time.perf_counter() - t0
    assert summary["status"] == "ok", summary["error"]
    assert summary["world_size"] == 2 and summary["coverage"] == 1.0
    assert summary["iteration_time_s"] > 0 and summary["peak_memory_bytes"] > 0
    kinds = summary["collectives"]
    assert {"all_reduce", "all_gather_into_tensor", "broadcast"} <= set(kinds)
    assert kinds["all_reduce"]["num_calls"] > 0
    on_disk = orjson.loads((tmp_path / "summary.json").read_bytes())
    assert on_disk["status"] == "ok" and len(on_disk["ranks"]) == 2
    for name in ("ranks.csv", "ranks.parquet", "memory/rank-0.csv", "memory/rank-1.csv",
                 "report.html"):  # the page too: no tracefleet-report needed to look at it
        assert (tmp_path / name).stat().st_size > 0
    # Phase timings: disjoint intervals of the run, so they add up to at most its total, and
    # the replay phase holds every measured iteration of the slowest rank.
    timings = on_disk["timings_s"]
    assert all(timings[phase] > 0 for phase in PHASES), timings
    assert sum(timings[phase] for phase in PHASES) <= timings["total_s"] <= wall_s
    assert timings["replay_s"] >= max(sum(r["iteration_times_s"]) for r in on_disk["ranks"])
    assert all(r["timings_s"]["trace_load_s"] > 0 for r in on_disk["ranks"])


def test_four_rank_full_replay(ray_session, traces4, tmp_path):
    summary = run_replay(_cfg(traces4), tmp_path)
    assert summary["status"] == "ok", summary["error"]
    assert [r["rank"] for r in summary["ranks"]] == [0, 1, 2, 3]
    assert all(r["status"] == "ok" and r["coverage"] == 1.0 for r in summary["ranks"])
    # gloo ran the trace's all-reduces: 4 ranks * parameters * iterations calls in total
    assert summary["collectives"]["all_reduce"]["num_calls"] % 4 == 0


def test_comms_mode_replays_only_collectives(ray_session, traces2, tmp_path):
    summary = run_replay(_cfg(traces2, mode="comms", iters=2, warmup_iters=0), tmp_path)
    assert summary["status"] == "ok", summary["error"]
    for rank in summary["ranks"]:
        trace = load_trace(traces2 / f"rank-{rank['rank']}.et.json", rank["rank"])
        expected = Counter(op.collective.kind for op in trace.collectives)
        # only the collectives are in scope, and each was replayed once per iteration
        assert rank["num_in_scope"] == sum(expected.values())
        assert rank["coverage"] == 1.0
        got = {kind: c["num_calls"] for kind, c in rank["collectives"].items()}
        assert got == {kind: 2 * n for kind, n in expected.items()}
        assert rank["comm_time_s"] > 0
        assert rank["compute_time_s"] == 0
    assert summary["collectives"]["all_reduce"]["busbw_gbps"] > 0


def test_mismatched_collectives_fail_before_launch(traces2, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(traces2, bad)
    doc = orjson.loads((bad / "rank-1.et.json").read_bytes())
    node = next(n for n in doc["nodes"] if n["name"] == "c10d::allreduce_")
    tensor = node["inputs"]["values"][0][0]
    tensor[3] += 1  # one more element on rank 1 only
    node["inputs"]["shapes"][0][0] = [tensor[3]]
    (bad / "rank-1.et.json").write_bytes(orjson.dumps(doc))
    # pre-flight's ConfigError, before any actor exists (a mismatch found by the replay would
    # be a failed run's summary, not an exception)
    with pytest.raises(ConfigError, match=r"rank"):
        run_replay(_cfg(bad), tmp_path / "out")
    assert not (tmp_path / "out" / "summary.json").exists()


def test_missing_rank_is_refused(traces2, tmp_path):
    partial = tmp_path / "partial"
    partial.mkdir()
    shutil.copy(traces2 / "rank-0.et.json", partial / "rank-0.et.json")
    with pytest.raises(ConfigError, match="world size|rank"):
        run_replay(_cfg(partial), tmp_path / "out")
    with pytest.raises(ConfigError, match="fewer|world size"):
        cfg = _cfg(traces2)
        cfg.experiment.world_size = 1
        run_replay(cfg, tmp_path / "out2")


# Fault tests time the span from the fault to the end of the wait, against the configured bound
# plus a margin: cluster and actor start stay outside it (they are the machine's speed, not the
# run's behaviour, and take minutes on a loaded 2-core machine). The margin is slack for a
# loaded machine (tests/support/bounds.py); what they guard against is a wait never bounded.
MARGIN_S = LOAD_MARGIN_S
FAULT_FILE = "fault_at"


def _mark_fault(request) -> None:
    """Write the wall-clock time of the fault beside the rank's trace, where the test reads it
    (one machine: one clock)."""
    (Path(request.trace_path).parent / FAULT_FILE).write_text(repr(time.time()))


class DyingRank(RankActor):
    """Rank 1 dies in the middle of the run."""

    def replay(self, *args, **kwargs):
        if int(os.environ["RANK"]) == 1:
            time.sleep(1)
            _mark_fault(args[0])
            os._exit(1)
        return super().replay(*args, **kwargs)


class HangingRank(RankActor):
    """Rank 1 never joins: the others block in the rendezvous / first collective."""

    def replay(self, *args, **kwargs):
        if int(os.environ["RANK"]) == 1:
            _mark_fault(args[0])
            time.sleep(3600)
        return super().replay(*args, **kwargs)


class MarkingRank(RankActor):
    """A plain rank that marks when rank 1 starts replaying (just before its fault)."""

    def replay(self, *args, **kwargs):
        if int(os.environ["RANK"]) == 1:
            _mark_fault(args[0])
        return super().replay(*args, **kwargs)


def _run_with_fault(cfg, out_dir, actor_cls) -> tuple[dict, float]:
    """``(summary, seconds from the fault to the end of the replay wait)``. The wait ends
    before the run's teardown and aggregation, whose spans the summary times."""
    fault_file = Path(cfg.trace.dir) / FAULT_FILE
    fault_file.unlink(missing_ok=True)
    summary = run_replay(cfg, out_dir, actor_cls=actor_cls)
    returned_at = time.time()
    timings = summary["timings_s"]
    wait_end = returned_at - timings["teardown_s"] - timings["aggregation_s"]
    assert fault_file.is_file(), "the faulty rank never reached its fault"
    return summary, wait_end - float(fault_file.read_text())


def test_dead_actor_ends_run_quickly(ray_session, traces2, tmp_path):
    cfg = _cfg(traces2)
    summary, fault_to_end_s = _run_with_fault(cfg, tmp_path, DyingRank)
    assert summary["status"] == "failed"
    assert "rank 1" in summary["error"]
    assert summary["ranks"][1]["status"] == "failed"
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "failed"
    # a dead actor ends the wait after the failure grace, long before replay_timeout_s
    assert fault_to_end_s < cfg.experiment.failure_grace_s + MARGIN_S
    assert fault_to_end_s < cfg.experiment.replay_timeout_s


def test_hanging_rank_times_out(ray_session, traces2, tmp_path):
    cfg = _cfg(traces2)
    cfg.experiment.replay_timeout_s = 8
    summary, fault_to_end_s = _run_with_fault(cfg, tmp_path, HangingRank)
    assert summary["status"] == "timeout"
    assert "rank 1" in summary["error"]
    # the wait lasted its bound (the hang started just after the wait did), and no longer
    timings = summary["timings_s"]
    window_s = timings["trace_load_s"] + timings["rendezvous_s"] + timings["replay_s"]
    assert window_s >= cfg.experiment.replay_timeout_s
    assert fault_to_end_s < cfg.experiment.replay_timeout_s + MARGIN_S


def test_raising_rank_names_rank_and_op(ray_session, traces2, tmp_path):
    bad = tmp_path / "strict"
    shutil.copytree(traces2, bad)
    doc = orjson.loads((bad / "rank-1.et.json").read_bytes())
    node = next(n for n in doc["nodes"] if n["name"] == "aten::mm")
    node["outputs"]["shapes"][0] = node["outputs"]["shapes"][0] + [1]
    (bad / "rank-1.et.json").write_bytes(orjson.dumps(doc))
    cfg = _cfg(bad, strict=True)
    summary, fault_to_end_s = _run_with_fault(cfg, tmp_path / "out", MarkingRank)
    assert summary["status"] in ("failed", "timeout")
    rank1 = summary["ranks"][1]
    assert rank1["status"] == "failed"
    assert f"node {node['id']} aten::mm" in rank1["error"]
    # rank 0 waits in a collective for its peer: bounded by the collective timeout
    assert fault_to_end_s < cfg.replay.collective_timeout_s + cfg.experiment.failure_grace_s \
        + MARGIN_S


def test_profile_writes_a_chrome_trace_per_rank(ray_session, traces2, tmp_path):
    summary = run_replay(_cfg(traces2, iters=1, warmup_iters=0, profile=True), tmp_path)
    assert summary["status"] == "ok", summary["error"]
    for rank in (0, 1):
        doc = json.loads((tmp_path / "profile" / f"rank-{rank}.pt.trace.json").read_text())
        names = {event.get("name") for event in doc["traceEvents"]}
        # the replayed operators and the gloo all-reduce show up in the profile
        assert "aten::mm" in names or "aten::addmm" in names
        assert any("allreduce" in str(n) for n in names)


def test_compute_mode_needs_no_process_group(ray_session, traces2, tmp_path):
    summary = run_replay(_cfg(traces2, mode="compute", alloc="lazy"), tmp_path)
    assert summary["status"] == "ok", summary["error"]
    on_disk = orjson.loads((tmp_path / "summary.json").read_bytes())
    for key in ("status", "coverage", "peak_memory_bytes", "liveness_lower_bound_bytes",
                "num_flushes", "iteration_time_s", "error", "ranks"):
        assert key in on_disk, key
    assert on_disk["error"] is None and on_disk["coverage"] == 1.0
    for rank in summary["ranks"]:
        # collectives are out of scope: nothing ran on a process group
        assert rank["comm_time_s"] == 0 and not rank["collectives"]
        assert rank["num_in_scope"] < rank["num_ops"] and rank["compute_time_s"] > 0
