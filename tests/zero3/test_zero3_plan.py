"""ZeRO-3 planning on a real capture of a known fine-grained model (data parallel, 2 ranks):
all-gathers per strategy as the model's structure dictates, DeepSpeed's leaf rule, prefetch,
traces without module ranges, and refusing a trace that ZeRO-3 itself recorded."""
from __future__ import annotations

import sys

import pytest
import torch

from actors.trace.conventions import trace_file_name
from actors.errors import ConfigError
from actors.trace import compute_liveness, load_trace
from actors.capture.finegrained_capture import capture_data_parallel
from actors.capture.workloads import finegrained_model as fg
from actors.zero3.config import Zero3Config
from actors.zero3.leaves import granularities
from actors.zero3.markers import read_backward_marks
from actors.zero3.modules import BWD, FWD, phases
from actors.zero3.fetch_plan import build_plan
from orchestrator.config import DEMO_TRACES

DEMO = DEMO_TRACES
MODEL = fg.FineGrainedConfig(d_model=16, num_blocks=2, linears_per_block=3, num_experts=8,
                             expert_hidden=8, batch_size=4)


@pytest.fixture(scope="module")
def capture(tmp_path_factory):
    """The model's recorded step on rank 0, its backward markers and the torch model."""
    out = capture_data_parallel(tmp_path_factory.mktemp("finegrained"), 2, MODEL)
    trace = load_trace(out / trace_file_name(0))
    return trace, read_backward_marks(trace), fg.FineGrained(MODEL)


def plan(trace, marks, world=2, **cfg):
    cfg.setdefault("param_persistence_threshold", 0)
    live = compute_liveness(trace.ops, trace.num_storages)
    return build_plan(trace, live, Zero3Config(**cfg), world, marks)


def units(model, leaf_classes=()) -> int:
    """Fetch units in one forward: modules with parameters of their own, a leaf with its
    subtree (DeepSpeed's rule)."""
    leaves = [m for m in model.modules() if isinstance(m, tuple(leaf_classes))]
    inside = {id(c) for leaf in leaves for c in leaf.modules() if c is not leaf}
    return sum(1 for m in model.modules() if id(m) not in inside
               and (m in leaves or any(True for _ in m.parameters(recurse=False))))


def test_allgathers_per_strategy_follow_the_model(capture):
    trace, marks, model = capture
    num_params = len(list(model.parameters()))
    counts = {s: len(plan(trace, marks, strategy=s, leaf_modules=fg.LEAF_PATTERNS).plan.gathers)
              for s in ("per_param", "per_module", "leaf_coalesced")}
    # No reuse: every unit is gathered in forward and again in backward.
    assert counts == {"per_param": 2 * num_params, "per_module": 2 * units(model),
                      "leaf_coalesced": 2 * units(model, fg.leaf_classes())}
    whole = plan(trace, marks, strategy="bucketed", prefetch_bucket_size=10**9).plan
    assert len(whole.gathers) == 1  # one bucket holds the model
    assert len(plan(trace, marks, strategy="bucketed", prefetch_bucket_size=1).plan.gathers) \
        == counts["per_param"]  # each bucket overflows at its second parameter


def test_leaf_gathers_are_flat_and_cover_the_subtree(capture):
    trace, marks, model = capture
    z = plan(trace, marks, strategy="leaf_coalesced", leaf_modules=fg.LEAF_PATTERNS)
    assert z.plan.leaves == ["blocks.0", "blocks.1", "moe"]
    moe = [g for g in z.plan.gathers if g.unit == "moe"]
    assert len(moe) == 2 and all(g.kind == "flat" for g in moe)
    assert sum(len(h.params) for h in moe[0].homes) == len(list(model.moe.parameters()))
    assert moe[0].numel >= sum(p.numel() for p in model.moe.parameters())


def test_persistence_threshold_keeps_small_parameters_gathered(capture):
    trace, marks, model = capture
    threshold = MODEL.d_model  # biases (16) and the gate's bias (8) stay; weights are partitioned
    z = plan(trace, marks, strategy="per_param", param_persistence_threshold=threshold)
    small = sum(1 for p in model.parameters() if p.numel() <= threshold)
    assert sum(1 for h in z.plan.homes if h.persistent) == small > 0
    assert len(z.plan.gathers) == 2 * (len(list(model.parameters())) - small)


def test_granularity_matches_deepspeeds_rule(capture, monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload
    trace, marks, model = capture
    for p in model.parameters():
        p.ds_numel = p.numel()
    ds = DeepSpeedZeRoOffload.__new__(DeepSpeedZeRoOffload)  # its rule, without an engine
    ds.min_granularity_value, ds.min_granularity_layer, ds.granularity_info = sys.maxsize, None, set()
    ds._get_granularity_recursively(model)
    ours = granularities(plan(trace, marks, strategy="per_module").tree)
    theirs = {name: m.ds_model_granularity for name, m in model.named_modules()}
    assert ours == theirs
    names = {id(m): name for name, m in model.named_modules()}
    for threshold in sorted({theirs["moe"], theirs["blocks.0"], theirs[""]}):
        ds.z3_leaf_layers = []
        ds._set_leaf_by_threshold_preorder(model, threshold)
        z = plan(trace, marks, strategy="leaf_coalesced", module_granularity_threshold=threshold)
        assert z.plan.leaves == sorted(names[id(m)] for m in ds.z3_leaf_layers), threshold


def test_prefetch_issues_the_next_gather_before_its_wait(capture):
    trace, marks, _ = capture
    plain = plan(trace, marks, strategy="per_module")
    ahead = plan(trace, marks, strategy="per_module", prefetch=True)
    assert len(ahead.plan.gathers) == len(plain.plan.gathers)

    def issued_and_waited(z):
        where = {}
        for b, events in z.plan.events.items():
            for kind, obj in events:
                if kind in ("gather", "wait"):
                    where.setdefault(obj.id, {})[kind] = b
        return where
    early = [g for g, w in issued_and_waited(ahead).items() if w["gather"] < w["wait"]]
    # All but the first, and the head's backward gather: when the head's forward gather is
    # waited for, the next one is the head's own backward fetch, of parameters still gathered.
    late = [g for g in ahead.plan.gathers if g.id not in early]
    assert [g.unit for g in late] == [plain.plan.gathers[0].unit, "head"]
    assert all(w["gather"] == w["wait"] for w in issued_and_waited(plain).values())
    tight = plan(trace, marks, strategy="per_module", prefetch=True, max_live_parameters=1)
    assert all(w["gather"] == w["wait"] for w in issued_and_waited(tight).values())


def test_trace_without_module_ranges(tmp_path):
    from tests.support.trace_factory import capture_step
    trace = load_trace(capture_step(tmp_path / "t.json", with_collective=False))
    assert not any(op.module.startswith("## module:") for op in trace.ops)
    phase = phases(trace)
    z = plan(trace, [], world=4, strategy="per_module")
    num = len(z.params)
    assert num == 5  # embedding, layer norm (2) and projection (2)
    forward = [g for g in z.plan.gathers if phase[_first_boundary(z, g)] == FWD]
    # per parameter, at first use in forward; again in backward for those backward reads
    assert sorted(h.params[0].index for g in forward for h in g.homes) == list(range(num))
    assert all(phase[_first_boundary(z, g)] == BWD for g in z.plan.gathers if g not in forward)
    grouped = plan(trace, [], world=4, strategy="leaf_coalesced", leaf_modules=["net"],
                   modules={"net": list(range(num))}, modules_by="order")
    assert [g.unit for g in grouped.plan.gathers] == ["net", "net"]  # forward and backward
    with pytest.raises(ConfigError, match="no detected parameter with order"):
        plan(trace, [], strategy="per_module", modules={"a": [num]}, modules_by="order")
    with pytest.raises(ConfigError, match="match no module"):
        plan(trace, [], strategy="leaf_coalesced", leaf_modules=["Block"])


def _first_boundary(z, gather) -> int:
    return min(b for b, events in z.plan.events.items() for kind, obj in events if obj is gather)


def test_trace_recorded_under_zero3_is_refused():
    trace = load_trace(DEMO / "gpt_zero3_2" / trace_file_name(0))
    with pytest.raises(ConfigError, match="recorded under ZeRO-3.*zero3.strategy=none"):
        plan(trace, [], strategy="per_module")


def test_bf16_weights_refreshed_from_fp32_masters_are_parameters(tmp_path):
    from torch.profiler import ExecutionTraceObserver
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 4))
    model.to(torch.bfloat16)
    masters = [p.detach().float().requires_grad_() for p in model.parameters()]
    opt = torch.optim.AdamW(masters, lr=1e-3)

    def step():
        model(torch.randn(2, 8, dtype=torch.bfloat16)).float().sum().backward()
        for p, m in zip(model.parameters(), masters):
            m.grad = p.grad.float()
            p.grad = None
        opt.step()
        with torch.no_grad():
            for p, m in zip(model.parameters(), masters):
                p.copy_(m)  # the bf16 weight refreshed from its master

    step()
    et = ExecutionTraceObserver()
    et.register_callback(str(tmp_path / "mp.json"))
    et.start()
    step()
    et.stop()
    et.unregister_callback()
    trace = load_trace(tmp_path / "mp.json")
    from actors.zero3.params import discover_params
    params = discover_params(trace, compute_liveness(trace.ops, trace.num_storages))
    assert sorted((p.dtype, p.numel) for p in params) == \
        sorted(("bfloat16", p.numel()) for p in model.parameters())
