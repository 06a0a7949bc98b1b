"""Meta stand-ins: ops that need values return what the trace recorded, and the replay goes on
with the recorded shapes; other errors keep failing; nothing changes on cpu."""
from __future__ import annotations

import pytest
import torch

from actors.replay import step_plan
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
    step = step_plan.compile_step(op, META, "compute")
    assert step.standin and step.fn(torch.empty((), device="meta")) == op.outputs[0].value
    assert standins.lookup(op, CPU) is None


@pytest.mark.parametrize("attrs, expected", [({"tensor_range": '{"0": [4, 9]}'}, 4), ({}, 0)])
def test_unrecorded_scalar_comes_from_the_input_range_or_zero(tmp_path, attrs, expected):
    item = et_json.node(10, "aten::item", schema="aten::item(Tensor self) -> Scalar",
                        inputs=[et_json.tensor(1, 1, 1, dtype="long int", shape=[])],
                        outputs=[et_json.scalar("<None>", "Int")], **attrs)
    op = load_trace(et_json.write_trace(tmp_path, [item])).ops[0]
    assert step_plan.compile_step(op, META, "compute").fn() == expected


def test_fallback_only_for_errors_that_need_values(value_trace):
    step = step_plan.compile_step(next(op for op in value_trace.ops if op.name == "aten::index"),
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


def test_a_functional_collectives_output_is_held_from_the_call_on_meta(tmp_path):
    """A meta dry run replays no collective; a functional collective makes its output inside
    the call (tensor and context parallel), so it is a stand-in, held from there: here across
    a 2000 B temporary made before the first op reads the gathered buffer."""
    t, s = et_json.tensor, et_json.scalar
    ones = "aten::ones(SymInt[] size, *, ScalarType? dtype=None) -> Tensor"
    path = et_json.write_trace(tmp_path, [
        et_json.node(3, "_c10d_functional::all_gather_into_tensor", schema=et_json.FUNC_ALL_GATHER,
                     inputs=[t(1, 1, 200), s(2), s("0", "String")], outputs=[t(2, 2, 400)]),
        et_json.node(4, "_c10d_functional::wait_tensor", schema=et_json.FUNC_WAIT,
                     inputs=[t(2, 2, 400)], outputs=[t(2, 2, 400)]),
        et_json.node(5, "aten::ones", schema=ones, inputs=[s([500], "GenericList[Int]")],
                     outputs=[t(3, 3, 500)]),
        et_json.node(6, "aten::relu", schema=et_json.RELU, inputs=[t(3, 3, 500)],
                     outputs=[t(4, 4, 500)]),
        et_json.node(7, "aten::clone", schema=et_json.CLONE, inputs=[t(2, 2, 400)],
                     outputs=[t(5, 5, 400)]),
    ])
    trace = load_trace(path)
    engine = ReplayEngine(trace, ReplayConfig(mode="compute", device="meta", iters=1,
                                              warmup_iters=0, measure_memory=False,
                                              allocation=AllocationConfig(mode="faithful")))
    report = engine.run().to_dict()
    assert report["status"] == "ok" and report["coverage"] == 1.0
    # at relu: the gathered 1600 B, the ones and its relu (2 x 2000 B) and the input (800 B,
    # made before the trace: held throughout); read first by clone, the gathered buffer would
    # be missing there
    assert report["accounted_peak_bytes"] == 800 + 1600 + 2 * 2000
    assert report["standin_ops"] == {"_c10d_functional::all_gather_into_tensor": 1,
                                     "_c10d_functional::wait_tensor": 1}
    assert step_plan.compile_step(trace.ops[0], CPU, "compute").kind == "skip"  # cpu: out of scope
