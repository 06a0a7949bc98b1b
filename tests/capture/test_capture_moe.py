"""The MoE block (actors/capture/workloads/moe.py) and expert parallel on the mesh: the routing
assumption and the fixed router that realizes it for real, EP captured on fake at world 4
(token counts exchanged, tokens dispatched by the assumed splits, this rank's experts only),
a skewed routing making the ep ranks roles of their own, and the refusals."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from actors.capture.workloads.mesh import ParallelismConfig, rank_roles, validate_parallelism
from actors.capture.workloads.moe import MoE, MoeRouter, MoeSpec, assumed_loads, fixed_assignment
from actors.capture.workloads.config import WorkloadConfig, validate
from actors.errors import ConfigError
from actors.trace import load_trace
from actors.trace.conventions import trace_file_name
from orchestrator.run.capture import CaptureConfig, run_capture_job
from tests.capture.test_capture_mesh import TINY, _dry_run

MOE = dict(moe_experts=4, moe_top_k=2, moe_ffn_dim=64)
TOKENS = TINY["batch_size"] * TINY["seq_len"]  # per rank


@pytest.mark.parametrize("tokens,top_k,experts,skew", [(64, 2, 4, 0.0), (10, 2, 4, 0.0),
                                                         (64, 2, 4, 0.5), (64, 2, 8, 3.0),
                                                         (7, 3, 5, 0.2)])
def test_assumed_loads_and_the_fixed_assignment_realizing_them(tokens, top_k, experts, skew):
    loads = assumed_loads(tokens, top_k, experts, skew)
    assert sum(loads) == tokens * top_k and max(loads) <= tokens
    if skew == 0:
        assert max(loads) - min(loads) <= 1
    else:  # the hot expert: (1 + skew) x the mean, the others even
        assert loads[0] == min(tokens, round(tokens * top_k * (1 + skew) / experts))
        assert max(loads[1:]) - min(loads[1:]) <= 1
    ids = fixed_assignment(loads, tokens, top_k)
    assert ids.shape == (tokens, top_k)
    assert torch.bincount(ids.view(-1), minlength=experts).tolist() == loads
    assert all(len(set(row)) == top_k for row in ids.tolist())  # a token's experts differ


def test_the_real_routers_count_what_they_route():
    torch.manual_seed(0)
    x = torch.randn(2, 16, 32)
    for router in MoeRouter:
        moe = MoE(32, MoeSpec(4, 2, 64, 1, router, 1.0))
        y = moe(x)
        y.sum().backward()
        assert y.shape == x.shape and moe.experts.w1.grad is not None
        ids = torch.topk(torch.softmax(moe.gate(x.view(-1, 32)).float(), -1), 2).indices \
            if router == MoeRouter.topk else fixed_assignment(moe._loads(32), 32, 2)
        counts = moe._token_counts(ids, 32).tolist()
        assert sum(counts) == 64
        if router == MoeRouter.fixed:  # the assumption, imposed
            assert counts == assumed_loads(32, 2, 4, 1.0) == [32, 11, 11, 10]


def _capture(out, parallelism, **fields):
    cfg = CaptureConfig(workload=WorkloadConfig(**{**TINY, **MOE, **fields},
                                                parallelism=parallelism),
                        world_size=4, out_dir=str(out))
    return run_capture_job(cfg).meta


@pytest.fixture(scope="module")
def ep_job(tmp_path_factory):
    out = tmp_path_factory.mktemp("ep")
    return out, _capture(out, {"ep": 2})


def _token_exchanges(trace):
    """The expert-parallel all-to-alls of a trace, forward first: (in splits, out splits)."""
    return [(op.collective.in_splits, op.collective.out_splits) for op in trace.collectives
            if op.collective.kind == "all_to_all_single"]


def test_ep_dispatches_tokens_by_the_assumed_splits(ep_job):
    out, meta = ep_job
    assert meta["mesh"]["roles"] == {"every rank": [0, 1, 2, 3]}  # balanced: ranks alike
    trace = load_trace(out / trace_file_name(0))
    exchanges = _token_exchanges(trace)
    per_block = TOKENS * 2 // 2  # top-2 routed tokens, half to each ep rank
    counts, dispatch, combine = exchanges[:3]
    assert counts == ((2, 2), (2, 2))  # the 4 experts' counts, 2 to each peer
    assert dispatch == combine == ((per_block, per_block), (per_block, per_block))
    # per layer: counts, dispatch, combine in forward; their gradients' in backward
    assert len(exchanges) == 5 * TINY["n_layers"]
    names = Counter(op.name for op in trace.ops)
    assert names["aten::_grouped_mm"] == 9 * TINY["n_layers"]  # 3 forward, 6 backward
    experts = [op for op in trace.ops if op.name == "aten::_grouped_mm"][0]
    routed, weight = (tuple(t.shape) for t in experts.input_tensors()[:2])
    assert routed == (2 * per_block, TINY["d_model"])  # the tokens this rank's experts got
    assert weight[0] == MOE["moe_experts"] // 2  # this rank's experts only
    groups = {g.desc: g for g in trace.process_groups}
    assert {"mesh_ep", "mesh_efsdp"} <= set(groups)
    assert _dry_run(out / trace_file_name(0))["status"] == "ok"


def test_ep_with_tp_splits_the_experts_both_ways(tmp_path):
    """torchtitan's ep x etp: dp_shard 2 lent to ep 2, tp 2; each rank holds half the experts,
    each with half its hidden units, and exchanges the whole sequence's tokens (tp all-gathers
    them for the MoE block) with the ep peer of its own tp index."""
    meta = _capture(tmp_path, {"ep": 2, "tp": 2})
    assert meta["mesh"]["roles"] == {"every rank": [0, 1, 2, 3]}
    trace = load_trace(tmp_path / trace_file_name(0))
    routed_per_peer = TOKENS * 2 // 2  # the dp rank's whole sequence (not its tp slice), top-2
    counts, dispatch, _ = _token_exchanges(trace)[:3]
    assert counts == ((2, 2), (2, 2))
    assert dispatch == ((routed_per_peer, routed_per_peer), (routed_per_peer, routed_per_peer))
    experts = [op for op in trace.ops if op.name == "aten::_grouped_mm"][0]
    w1 = tuple(experts.input_tensors()[1].shape)
    assert w1[0] == MOE["moe_experts"] // 2 and MOE["moe_ffn_dim"] // 2 in w1[1:]
    groups = {g.desc: g for g in trace.process_groups}
    assert {"mesh_ep", "mesh_efsdp", "mesh_tp"} <= set(groups)
    assert tuple(groups["mesh_ep"].ranks) == (0, 2)  # the ep peer of the same tp index
    assert _dry_run(tmp_path / trace_file_name(0))["status"] == "ok"


def test_a_skewed_routing_makes_the_ep_ranks_roles(tmp_path):
    meta = _capture(tmp_path, {"ep": 2}, moe_routing_skew=1.0)
    assert meta["mesh"]["roles"] == {"ep rank 0": [0, 2], "ep rank 1": [1, 3]}
    hot, cold = (_token_exchanges(load_trace(tmp_path / trace_file_name(r)))[1] for r in (0, 1))
    loads = assumed_loads(TOKENS, 2, 4, 1.0)  # expert 0, on ep rank 0, takes twice the mean
    assert hot == ((sum(loads[:2]), sum(loads[2:])), (sum(loads[:2]),) * 2)
    assert cold[1] == (sum(loads[2:]),) * 2
    peaks = [_dry_run(tmp_path / trace_file_name(r))["accounted_peak_bytes"] for r in (0, 1)]
    assert peaks[0] > peaks[1]


def test_moe_without_ep_runs_on_meta(tmp_path):
    cfg = CaptureConfig(workload=WorkloadConfig(**{**TINY, **MOE, "parallel": "local",
                                                   "precision": "bf16", "device": "meta"}),
                        world_size=2, out_dir=str(tmp_path))
    run_capture_job(cfg)
    trace = load_trace(tmp_path / trace_file_name(0))
    first = next(op for op in trace.ops if op.name == "aten::_grouped_mm")
    assert tuple(first.input_tensors()[0].shape) == (2 * TOKENS, TINY["d_model"])


@pytest.mark.parametrize("fields,parallelism,message", [
    ({}, {"ep": 2, "dp_shard": 4}, "set workload.moe_experts"),
    ({"moe_experts": 3}, {"ep": 2}, "not divisible by ep=2"),
    ({"moe_experts": 4}, {"ep": 4, "dp_shard": 2, "dp_replicate": 2},
     "ep=4 must divide dp_shard x cp = 2"),
    ({"moe_experts": 4, "moe_ffn_dim": 63}, {"tp": 2, "ep": 2}, "not divisible by tp=2"),
    ({"moe_experts": 4}, {"ep": 2, "pp": 2, "dp_shard": 2}, "under pipeline parallel"),
])
def test_expert_parallel_that_cannot_run_is_refused(fields, parallelism, message):
    cfg = WorkloadConfig(**{**TINY, **fields}, parallelism=ParallelismConfig(**parallelism))
    with pytest.raises(ConfigError, match=message):
        validate_parallelism(cfg, 4)


@pytest.mark.parametrize("fields,message", [
    ({"moe_experts": 4, "moe_top_k": 5}, "moe_top_k=5: must be 1 to moe_experts=4"),
    ({"moe_experts": 4, "moe_routing_skew": 1.5}, "must be 0 to moe_experts / moe_top_k - 1"),
    ({"moe_experts": 4, "model": "gpt"}, r"model=gpt has no MoE block \(the families with "
                                         "one: llama, qwen3, deepseek_v3, llama4\)"),
    ({"moe_experts": -1}, "must be >= 0"),
])
def test_moe_knobs_are_checked(fields, message):
    with pytest.raises(ConfigError, match=message):
        validate(WorkloadConfig(**{**TINY, **fields}))


def test_ep_ranks_are_alike_unless_skewed():
    par = ParallelismConfig(dp_shard=2, cp=2, ep=4)
    assert rank_roles(par, 4) == {"cp rank 0": [0, 2], "cp rank 1": [1, 3]}
    assert rank_roles(par, 4, skewed_experts=True) == {
        f"cp rank {c}, ep rank {e}": [r] for r, (c, e) in enumerate(
            [(0, 0), (1, 1), (0, 2), (1, 3)])}
