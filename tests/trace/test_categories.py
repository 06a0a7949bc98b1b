"""The peak's breakdown by category: storages classified from the trace, bytes at the peak."""
from __future__ import annotations

import json

import pytest

from actors.replay.config import AllocationConfig, ReplayConfig
from actors.replay.engine import ReplayEngine
from actors.trace import load_trace
from actors.trace.categories import CATEGORIES, storage_categories
from actors.trace.liveness import compute_liveness
from orchestrator.config import DEMO_TRACES

DEMO = DEMO_TRACES / "gpt_dp_4"


@pytest.fixture(scope="module")
def demo():
    assert (DEMO / "rank-0.et.json.gz").is_file(), f"bundled demo trace missing in {DEMO}"
    meta = json.loads((DEMO / "meta.json").read_text())
    return load_trace(DEMO / "rank-0.et.json.gz"), meta


def _bytes_by_category(trace) -> dict[str, int]:
    live = compute_liveness(trace.ops, trace.num_storages)
    out = dict.fromkeys(CATEGORIES, 0)
    for s, c in enumerate(storage_categories(trace, live)):
        if live.storage_first[s] >= 0:
            out[CATEGORIES[c]] += live.storage_bytes[s]
    return out


def test_model_states_of_an_fp32_adamw_data_parallel_step(demo):
    trace, meta = demo
    assert meta["workload"]["precision"] == "fp32"
    param_bytes = 4 * meta["num_params"]
    got = _bytes_by_category(trace)
    assert got["parameters"] == param_bytes
    assert got["gradients"] == param_bytes  # one fp32 gradient per parameter
    # AdamW: exp_avg and exp_avg_sq per parameter, plus one-element step counters
    assert 2 * param_bytes <= got["optimizer_state"] <= 2 * param_bytes + 4096
    assert got["communication"] > 0  # the gradient buckets all-reduced
    assert got["activations"] > 0


@pytest.mark.parametrize("mode", ["faithful", "lazy"])
def test_peak_breakdown_sums_to_the_peak_and_names_its_op(demo, mode):
    trace, _ = demo
    report = ReplayEngine(trace, ReplayConfig(
        mode="compute", device="meta", iters=1, warmup_iters=0, measure_memory=False,
        allocation=AllocationConfig(mode=mode))).run().to_dict()
    assert report["status"] == "ok", report["error"]
    breakdown = report["peak_breakdown"]
    assert sum(breakdown.values()) == report["accounted_peak_bytes"]
    assert all(v >= 0 for v in breakdown.values())
    op = report["peak_op"]
    assert trace.ops[op["index"]].node_id == op["node_id"]
    assert trace.ops[op["index"]].name == op["op"]
    if mode == "lazy":  # lazy holds no parameter before its first use: the peak is in backward
        assert breakdown["activations"] > 0


def test_summary_takes_the_breakdown_of_the_rank_with_the_largest_peak():
    from orchestrator.run.aggregate import aggregate
    from orchestrator.reports.run_report import breakdown_line

    def rank(r, peak, acts):
        return {"rank": r, "status": "ok", "accounted_peak_bytes": peak,
                "peak_memory_bytes": peak, "iteration_times_s": [0.1],
                "peak_breakdown": {"parameters": peak - acts, "activations": acts},
                "peak_op": {"node_id": 10 + r, "op": "aten::mm", "index": r, "hook": False}}

    summary = aggregate([rank(0, 100, 40), rank(1, 300, 200)], world_size=2)
    assert summary["peak_breakdown"] == {"parameters": 100, "activations": 200}
    assert summary["peak_op"]["rank"] == 1 and summary["peak_op"]["node_id"] == 11
    line = breakdown_line(summary)
    assert line.startswith("peak (accounted) at rank 1 node 11 aten::mm: activations 200")
    assert line.index("activations") < line.index("parameters")  # largest first
