"""FSDP2 traces as they really are: DTensor ops replaced by the local ops under them, and
unsharded parameters re-allocated at every all-gather (a real 2-rank gloo capture)."""
from __future__ import annotations

from collections import Counter

import pytest

from actors.replay.config import AllocationConfig, ReplayConfig
from actors.replay.engine import ReplayEngine
from actors.trace import load_trace
from actors.trace.liveness import compute_liveness
from tests.support.trace_factory import et_tail, run_rank_script

# Two blocks of Linears under fully_shard with a bf16 MixedPrecisionPolicy, AdamW (foreach
# off: one op per parameter and state), one iteration recorded after two warm-ups.
_FSDP2_CAPTURE = r'''
import os, sys
from datetime import timedelta
import torch, torch.distributed as dist, torch.nn as nn
from torch.profiler import ExecutionTraceObserver, record_function
from torch.distributed.fsdp import fully_shard, MixedPrecisionPolicy
from torch.distributed.device_mesh import init_device_mesh

rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                        world_size=world, timeout=timedelta(seconds=60))
mesh = init_device_mesh("cpu", (world,))
torch.manual_seed(0)
model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64))
                        for _ in range(2)])
mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
for block in model:
    fully_shard(block, mesh=mesh, mp_policy=mp)
fully_shard(model, mesh=mesh, mp_policy=mp)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)

def step():
    model(torch.randn(8, 64)).float().pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
''' + et_tail(warmup="step(); step()",
                  recorded='with record_function("ProfilerStep#2"):\n    step()')
NUM_PARAMS = 8  # 2 blocks x 2 Linears x (weight, bias)


@pytest.fixture(scope="module")
def fsdp2_trace(tmp_path_factory):
    out = run_rank_script(_FSDP2_CAPTURE, tmp_path_factory.mktemp("fsdp2"), 2, "FSDP2 capture")
    return load_trace(out / "rank-0.json")


def test_optimizer_runs_on_local_shards_not_on_dtensor_wrappers(fsdp2_trace):
    lerps = [op for op in fsdp2_trace.ops if op.name == "aten::lerp_"]
    assert len(lerps) == NUM_PARAMS  # one exp_avg update per parameter
    exp_avgs = [op.input_tensors()[0] for op in lerps]
    # DTensor wrappers share one storage id; the local exp_avg shards are distinct storages
    assert len({t.suid for t in exp_avgs}) == NUM_PARAMS
    # local shards: half of each fp32 parameter (64x128 weights split over 2 ranks)
    assert Counter(t.numel for t in exp_avgs)[64 * 128 // 2] == 2 * 2
    assert all(t.dtype == "float32" for t in exp_avgs)
    assert not any(op.name == "PythonSubclass" for op in fsdp2_trace.ops)


def test_unsharded_parameters_live_from_their_all_gather_to_their_last_use(fsdp2_trace):
    trace = fsdp2_trace
    live = compute_liveness(trace.ops, trace.num_storages)
    copies = [op for op in trace.ops if op.name == "fsdp::split_with_sizes_copy"]
    assert len(copies) >= 4  # each block gathered in forward and again in backward
    generations = Counter()
    for op in copies:
        for arg in op.inputs:
            if getattr(arg, "kind", None) == "tensor_list":
                for t in arg.value:
                    assert t.suid in trace.made_inside  # made in the iteration, not before
                    assert op.index - 10 <= live.storage_first[t.suid] <= op.index
                    generations[t.storage_id] += 1
    assert max(generations.values()) >= 2  # one storage id, a new generation per all-gather
    # faithful does not keep them across the iteration: below holding every generation
    report = ReplayEngine(trace, ReplayConfig(
        mode="compute", device="meta", iters=1, warmup_iters=1, measure_memory=False,
        allocation=AllocationConfig(mode="faithful"))).run().to_dict()
    assert report["status"] == "ok", report["error"]
    full = 2 * (64 * 128 + 128 + 128 * 64 + 64)  # parameter elements of the model
    # AdamW's fp32 exp_avg and exp_avg_sq of this rank's half, held across iterations
    assert report["peak_breakdown"]["optimizer_state"] >= 2 * 4 * full // 2


def test_a_reduce_scatter_input_lives_until_the_next_post_backward(fsdp2_trace):
    """FSDP2 keeps a module's reduce-scatter input in its state until the next module's
    post-backward: the replay holds it that long, not only to the reduce-scatter."""
    from actors.trace.fsdp2_lifetimes import REDUCE_RANGE, hold_reduce_scatter_inputs

    trace = fsdp2_trace
    calls = [op for op in trace.ops if op.collective is not None
             and op.collective.kind == "reduce_scatter_tensor"]
    assert len(calls) >= 2 and all(op.module.startswith(REDUCE_RANGE) for op in calls)
    live = compute_liveness(trace.ops, trace.num_storages)
    inputs = [t.suid for t in calls[0].input_tensors()
              if live.storage_last[t.suid] == calls[0].index]
    assert inputs  # the flat input dies at its reduce-scatter in the trace
    assert hold_reduce_scatter_inputs(trace.ops, live) >= len(calls) - 1
    start = calls[1].index
    while trace.ops[start - 1].module == calls[1].module:
        start -= 1
    for s in inputs:
        assert live.storage_last[s] == start - 1 > calls[0].index
        assert s in live.free_after[start - 1] and s not in live.free_after[calls[0].index]


def test_side_stream_storages_are_the_flat_gathers_and_the_reduce_scatter_outputs(fsdp2_trace):
    """The allocator model serves these from FSDP2's side-stream pools (fsdp2_streams.py):
    each all-gather's flat output on the copy-in stream, each reduce-scatter's output (the
    sharded gradients) on the reduce-scatter stream, no compute op's output on either."""
    from actors.trace.fsdp2_streams import (ALL_GATHER_COPY_IN_STREAM, REDUCE_SCATTER_STREAM,
                                            side_stream_storages)

    trace = fsdp2_trace
    streams = side_stream_storages(trace.ops)
    gathers = [op for op in trace.ops if op.name == "fsdp::all_gather_copy_in"]
    scatters = [op for op in trace.ops if op.collective is not None
                and op.collective.kind == "reduce_scatter_tensor"]
    assert len(gathers) >= 4 and len(scatters) >= 2
    flat_outputs = {op.output_tensors()[-1].suid for op in gathers}
    assert {streams.get(s) for s in flat_outputs} == {ALL_GATHER_COPY_IN_STREAM}
    rs_outputs = {op.input_tensors()[0].suid for op in scatters}
    rs_inputs = {op.input_tensors()[1].suid for op in scatters}
    assert {s for s, v in streams.items() if v == REDUCE_SCATTER_STREAM} == rs_outputs
    assert not rs_inputs & streams.keys()  # the flat input is made on the compute stream
    computed = {t.suid for op in trace.ops if op.name in ("aten::addmm", "aten::mm")
                for t in op.output_tensors()}
    assert computed and not computed & streams.keys()
    # the unsharded parameters FSDP2 copies out are compute-stream storages too
    copies = [t.suid for op in trace.ops if op.name == "fsdp::split_with_sizes_copy"
              for arg in op.inputs if getattr(arg, "kind", None) == "tensor_list"
              for t in arg.value]
    assert copies and not set(copies) & streams.keys()
