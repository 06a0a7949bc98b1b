"""Meta stand-ins: ops that need values return what the trace recorded, and the replay goes on
with the recorded shapes; other errors keep failing; nothing changes on cpu."""
from __future__ import annotations

import pytest
import torch

from actors.replay import steps as plan
from actors.replay.ops import standins
from actors.replay.config import AllocationConfig, ReplayConfig
from actors.replay.engine import ReplayEngine
from actors.trace import load_trace
from tests.support import et_json
from tests.support.foreign_ops import record

CPU, META = torch.device("cpu"), torch.device("meta")


def _program():
    """Every kind of value-dependent op, each result used by a later op."""
    x = torch.randn(16)
    counts = torch.randint(0, 3, (5,))
    scale = x.sum().item()
    nonzero = torch.nonzero(x > 0)
    picked = x[nonzero[:, 0]]  # an index by the nonzero result: runs on meta
    selected = torch.masked_select(x, x > 0.5)
    unique = torch.unique(counts)
    bins = torch.bincount(counts)
    negative = x[x < 0]  # a boolean-mask index: fails on meta, stood in when it raises
    repeated = torch.repeat_interleave(counts)  # no output_size: fails on meta likewise
    return (picked.sum() + selected.sum() + negative.sum() + unique.sum() + bins.sum()
            + repeated.sum()) * scale


@pytest.fixture(scope="module")
def value_trace(tmp_path_factory):
    torch.manual_seed(0)
    return load_trace(record(tmp_path_factory.mktemp("values") / "values.json", _program))


def _cfg(device, strict=True):
    return ReplayConfig(mode="compute", device=device, iters=2, warmup_iters=0, strict=strict,
                        allocation=AllocationConfig(mode="lazy"))


def test_meta_replay_stands_in_for_every_value_dependent_op(value_trace):
    """strict: every output, stood in or computed after a stand-in, has the recorded shape."""
    report = ReplayEngine(value_trace, _cfg("meta")).run().to_dict()
    assert report["status"] == "ok", report["error"]
    assert report["coverage"] == 1.0 and report["num_shape_mismatches"] == 0
    assert report["standin_ops"] == {
        "aten::item": 1, "aten::nonzero": 1, "aten::masked_select": 1, "aten::_unique2": 1,
        "aten::bincount": 1, "aten::index": 1, "aten::repeat_interleave": 1}


def test_cpu_replay_computes_them(value_trace):
    """Not strict: on synthetic data, value-dependent shapes differ from the trace's."""
    report = ReplayEngine(value_trace, _cfg("cpu", strict=False)).run().to_dict()
    assert report["status"] == "ok", report["error"]
    assert report["standin_ops"] == {} and report["coverage"] == 1.0


def _item(value_trace):
    return next(op for op in value_trace.ops if op.name == "aten::item")


def test_item_returns_the_recorded_scalar(value_trace):
    op = _item(value_trace)
    step = plan.compile_step(op, META, "compute")
    assert step.standin and step.fn(torch.empty((), device="meta")) == op.outputs[0].value
    assert standins.lookup(op, CPU) is None


@pytest.mark.parametrize("attrs, expected", [({"tensor_range": '{"0": [4, 9]}'}, 4), ({}, 0)])
def test_unrecorded_scalar_comes_from_the_input_range_or_zero(tmp_path, attrs, expected):
    item = et_json.node(10, "aten::item", schema="aten::item(Tensor self) -> Scalar",
                        inputs=[et_json.tensor(1, 1, 1, dtype="long int", shape=[])],
                        outputs=[et_json.scalar("<None>", "Int")], **attrs)
    op = load_trace(et_json.write_trace(tmp_path, [item])).ops[0]
    assert plan.compile_step(op, META, "compute").fn() == expected


def test_fallback_only_for_errors_that_need_values(value_trace):
    step = plan.compile_step(next(op for op in value_trace.ops if op.name == "aten::index"),
                             META, "compute")
    with pytest.raises(NotImplementedError) as needs_values:
        step.fn(torch.empty(16, device="meta"), [torch.empty(16, dtype=torch.bool, device="meta")])
    standin = standins.fallback(step, needs_values.value)
    assert standin is not None and standin().shape == step.op.outputs[0].shape
    assert standins.fallback(step, RuntimeError("shape '[4, 4]' is invalid for input of size 15")) \
        is None


@pytest.mark.parametrize("name", sorted(standins.VALUE_DEPENDENT))
def test_value_dependent_names_are_ops_of_this_torch(name):
    namespace, _, op = name.partition("::")
    assert hasattr(getattr(torch.ops, namespace), op)
