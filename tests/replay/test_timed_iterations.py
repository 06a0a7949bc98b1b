"""The median's confidence interval and the stopping rule (actors/replay/timed_iterations.py):
hand-worked intervals, and a 2-rank replay with replay.min_time_s whose ranks stop together."""
from __future__ import annotations

import json
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from actors.errors import ConfigError
from actors.replay.config import AllocationConfig, ReplayConfig
from actors.replay.extension_contract import ReplayExtension
from actors.replay.timed_iterations import (StopRule, interval_fields, median_interval,
                                            order_statistic_rank)
from orchestrator.run.aggregate import aggregate
from orchestrator.reports.run_report import interval_text
from orchestrator.results import summary_columns


# --- the interval, worked by hand -----------------------------------------------------------
def test_too_few_samples_have_no_95_interval():
    # n=5: even [min, max] misses the median with probability 2/32 = 6.25% > 5%
    assert order_statistic_rank(5) is None
    assert median_interval([1, 2, 3, 4, 5]) is None
    assert interval_fields([1.0, 2.0, 3.0])["iteration_time_ci_low_s"] is None


def test_six_samples_give_min_to_max():
    ci = median_interval([6, 1, 5, 2, 4, 3])
    # P(B <= 0) = 1/64 <= 2.5%, P(B <= 1) = 7/64 > 2.5%: j = 1, level 1 - 2/64
    assert (ci.low, ci.median, ci.high) == (1, 3.5, 6)
    assert ci.level == pytest.approx(62 / 64)


def test_ten_samples_drop_one_from_each_end():
    xs = [10, 3, 7, 1, 9, 5, 2, 8, 4, 6]
    ci = median_interval(xs)
    # P(B <= 1) = 11/1024 <= 2.5%, P(B <= 2) = 56/1024 > 2.5%: [x(2), x(9)]
    assert (ci.low, ci.high, ci.median) == (2, 9, 5.5)
    assert ci.level == pytest.approx(1 - 22 / 1024)
    assert ci.rel_half_width == pytest.approx(3.5 / 5.5)


def test_twenty_samples_give_x6_to_x15():
    ci = median_interval(range(1, 21))
    # P(B <= 5) = (1+20+190+1140+4845+15504)/2^20 = 21700/2^20 = 2.07%; P(B <= 6) = 5.77%
    assert (ci.low, ci.high) == (6, 15)
    assert ci.level == pytest.approx(1 - 2 * 21700 / 2 ** 20)


def test_a_preempted_iteration_does_not_move_the_interval():
    steady = [0.050 + 0.001 * (k % 5) for k in range(20)]
    spiky = steady[:-1] + [5.0]  # one iteration 100x slower
    assert median_interval(spiky).low == median_interval(steady).low
    assert median_interval(spiky).high == median_interval(steady).high


# --- the rule --------------------------------------------------------------------------------
def test_fixed_count_stops_at_iters():
    rule = StopRule(iters=4)
    assert [rule.done(1.0 + k) for k in range(4)] == [False, False, False, True]
    assert rule.reason == "replay.iters" and rule.planned == 4


def test_adaptive_stops_when_the_interval_is_within_target():
    rule = StopRule(iters=6, min_time_s=0.5, ci_target=0.05, max_iters=50)
    # 0.1 s each: 6 samples pass min_time_s and their interval is [0.1, 0.1]
    steps = [rule.done(0.1) for _ in range(6)]
    assert steps == [False] * 5 + [True] and rule.reason == "interval within +-5%"


def test_adaptive_waits_for_min_time_then_the_interval():
    rule = StopRule(iters=6, min_time_s=2.0, ci_target=0.05, max_iters=100)
    n = 0
    while not rule.done(0.1):
        n += 1
    assert n + 1 == 20  # 20 x 0.1 s reach min_time_s


def test_adaptive_hits_the_cap_on_noise():
    rule = StopRule(iters=6, min_time_s=0.01, ci_target=0.05, max_iters=12)
    times = [0.1, 0.2] * 6  # alternating: the median's interval spans both, never +-5%
    stops = [rule.done(t) for t in times]
    assert stops == [False] * 11 + [True]
    assert rule.reason.startswith("replay.max_iters")


def test_shared_time_is_what_the_rule_decides_on():
    seen = []
    rule = StopRule(iters=6, min_time_s=0.01, ci_target=0.05, max_iters=12,
                    share=lambda s: seen.append(s) or 0.1)  # the world's max is steady
    stops = [rule.done(t) for t in [0.01, 0.09] * 3]  # this rank alone is not
    assert stops[-1] and rule.series == [0.1] * 6 and seen == [0.01, 0.09] * 3


def test_config_refuses_a_cap_below_iters():
    with pytest.raises(ConfigError, match="max_iters"):
        ReplayConfig(iters=20, min_time_s=1.0, max_iters=10).validate()
    with pytest.raises(ConfigError, match="ci_target"):
        ReplayConfig(ci_target=0).validate()


def test_summary_row_and_console_carry_the_interval():
    ranks = [{"rank": r, "status": "ok", "iteration_time_s": 0.05,
              "iteration_times_s": [0.05 + 0.001 * k + 0.004 * r for k in range(10)]}
             for r in range(2)]
    summary = aggregate(ranks, world_size=2)
    # slowest rank per iteration: rank 1's 0.054..0.063; [x(2), x(9)]
    assert summary["iteration_time_ci_low_s"] == pytest.approx(0.055)
    assert summary["iteration_time_ci_high_s"] == pytest.approx(0.062)
    assert summary["num_timed_iterations"] == 10
    row = summary_columns(summary)
    assert row["iteration_time_ci_low_s"] == summary["iteration_time_ci_low_s"]
    assert interval_text(summary) == "95% CI 55.0-62.0 ms over 10 iters"
    assert interval_text({"num_timed_iterations": 3}) == "no 95% CI: 3 iters, 6 needed"


# --- two ranks in lockstep stop after the same iteration -------------------------------------
class _Jitter(ReplayExtension):
    """On one rank only, spins after the last op in every other iteration: that rank's own
    times alternate, its peer's (which waits for it outside the timed window) do not."""

    name = "jitter"

    def __init__(self, last: int, seconds: float):
        self.last, self.seconds, self.count = last, seconds, 0

    def hooks(self):
        def spin():
            self.count += 1
            end = time.perf_counter() + (self.seconds if self.count % 2 else 0.0)
            while time.perf_counter() < end:
                pass
        return {}, {self.last: [spin]}


def _rank(rank, world, init_file, trace_dir, out_dir, cases):
    from actors.replay.comm.replayer import CollectiveReplayer
    from actors.replay.engine import ReplayEngine
    from actors.replay.comm.process_groups import ProcessGroups, merge_group_tables
    from actors.trace import load_trace

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))
    try:
        traces = [load_trace(f"{trace_dir}/rank-{r}.et.json") for r in range(world)]
        table = merge_group_tables([t.process_groups for t in traces], world)
        groups = ProcessGroups.create(table, rank, world, "gloo", timeout_s=60)
        trace = traces[rank]
        out = {}
        for name, jitter_s, kw in cases:
            cfg = ReplayConfig(mode="full", device="cpu", warmup_iters=1, measure_memory=False,
                               allocation=AllocationConfig(mode="faithful"),
                               collective_timeout_s=60, **kw)
            ext = [_Jitter(len(trace.ops) - 1, jitter_s)] if rank == 1 and jitter_s else []
            comm = CollectiveReplayer(groups, torch.device("cpu"), ops=trace.ops)
            out[name] = ReplayEngine(trace, cfg, comm=comm, rank=rank, extensions=ext).run().to_dict()
        with open(f"{out_dir}/{rank}.json", "w") as f:
            json.dump(out, f)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_with_min_time_stop_together_within_the_cap(tmp_path):
    from tests.support.trace_factory import capture_ranks

    trace_dir = capture_ranks(tmp_path / "traces", 2)
    cases = [  # (name, rank 1's extra spin every other iteration, replay config)
        ("noisy", 0.03, dict(iters=6, min_time_s=0.001, ci_target=0.05, max_iters=12)),
        ("easy", 0.0, dict(iters=6, min_time_s=0.001, ci_target=0.9, max_iters=40)),
    ]
    mp.spawn(_rank, args=(2, str(tmp_path / "init"), str(trace_dir), str(tmp_path), cases),
             nprocs=2, join=True)
    reports = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]
    for name, _, kw in cases:
        got = [rep[name] for rep in reports]
        assert [g["status"] for g in got] == ["ok", "ok"], [g["error"] for g in got]
        counts = {len(g["iteration_times_s"]) for g in got}
        assert len(counts) == 1, (name, counts)  # the same iteration on both ranks
        (n,) = counts
        assert kw["iters"] <= n <= kw["max_iters"]
        assert got[0]["timing_stop_reason"] == got[1]["timing_stop_reason"]
    # rank 1's alternating 30 ms never lets the shared interval within +-5%: the cap ends it,
    # on rank 0 too, whose own iterations did not carry the spin
    noisy = [rep["noisy"] for rep in reports]
    assert len(noisy[0]["iteration_times_s"]) == 12
    assert noisy[0]["timing_stop_reason"].startswith("replay.max_iters")
    # a loose target is met before the cap (at 6 on a quiet machine), on both ranks alike
    easy = reports[0]["easy"]
    assert len(easy["iteration_times_s"]) < 40 and easy["timing_stop_reason"] == "interval within +-90%"
