"""Comparing a fake capture with a real one (actors/trace/fake_vs_real.py) on hand-made traces:
what the gloo backend adds and the autograd engine's in-place accumulation are not divergences;
a missing op is, named at its place."""
from __future__ import annotations

from actors.trace.fake_vs_real import ENGINE_FRAME, compare_captures
from tests.support.et_json import ADD, ADD_, CLONE, RELU, THREAD_ROOT, node, scalar, step_node, \
    tensor, tensor_list, write_trace
from tests.trace.test_trace_loader import ALLREDUCE

CHUNK = "aten::chunk(Tensor(a -> *) self, int chunks, int dim=0) -> Tensor(a)[]"


def _relu(nid, k, parent=4, **attrs):
    return node(nid, "aten::relu", parent=parent, inputs=[tensor(k, k, 8)],
                outputs=[tensor(k + 1, k + 1, 8)], schema=RELU, **attrs)


def _accumulate(nid, name, parent):
    """The engine adding a gradient's second part into its first (50 += 60 -> 61)."""
    schema, out = (ADD_, tensor(50, 50, 8)) if name == "aten::add_" else (ADD, tensor(61, 61, 8))
    return node(nid, name, parent=parent, inputs=[tensor(50, 50, 8), tensor(60, 60, 8),
                                                  scalar(1)], outputs=[out], schema=schema)


def _real(tmp_path, drop_relu=False):
    """A step as gloo records it: an all-reduce whose clone (storage 90) the caller chunks
    afterwards, a copy on gloo's thread, and the engine's in-place accumulation."""
    nodes = [step_node(4, 0), _relu(5, 10), node(6, "c10d::allreduce_", parent=4, schema=ALLREDUCE,
                                                 inputs=[tensor_list(tensor(11, 11, 8)),
                                                         scalar("<Object>", "Object"),
                                                         scalar("<Object>", "Object"),
                                                         scalar(None, "None"),
                                                         scalar(False, "Bool"), scalar(-1)],
                                                 outputs=[tensor_list(tensor(11, 11, 8))]),
             node(7, "aten::clone", parent=6, inputs=[tensor(11, 11, 8)],
                  outputs=[tensor(90, 90, 8)], schema=CLONE),
             node(8, "aten::chunk", parent=4, inputs=[tensor(90, 90, 8), scalar(2), scalar(0)],
                  outputs=[tensor_list(tensor(91, 90, 4), tensor(92, 90, 4, offset=4))],
                  schema=CHUNK),
             node(9, THREAD_ROOT, parent=1), _relu(10, 30, parent=9, tid="2"),
             node(12, ENGINE_FRAME + "MulBackward0", parent=4),
             _accumulate(13, "aten::add_", 12)]
    if not drop_relu:
        nodes.append(_relu(14, 40))
    return write_trace(tmp_path, nodes, name="real.json")


def _fake(tmp_path):
    nodes = [step_node(4, 0), _relu(5, 10), node(6, "c10d::allreduce_", parent=4, schema=ALLREDUCE,
                                                 inputs=[tensor_list(tensor(11, 11, 8)),
                                                         scalar("<Object>", "Object"),
                                                         scalar("<Object>", "Object"),
                                                         scalar(None, "None"),
                                                         scalar(False, "Bool"), scalar(-1)],
                                                 outputs=[tensor_list(tensor(11, 11, 8))]),
             node(12, ENGINE_FRAME + "MulBackward0", parent=4),
             _accumulate(13, "aten::add", 12), _relu(14, 40)]
    return write_trace(tmp_path, nodes, name="fake.json")


def test_backend_work_and_in_place_accumulation_are_not_divergences(tmp_path):
    check = compare_captures(_real(tmp_path), _fake(tmp_path))
    assert check.equal, check.to_dict()
    assert (check.num_backend_ops, check.num_accumulations) == (2, 1)  # chunk, the thread's relu
    assert check.num_compared_real == check.num_compared_fake == 4


def test_a_missing_op_is_named_where_the_runs_part(tmp_path):
    check = compare_captures(_real(tmp_path, drop_relu=True), _fake(tmp_path))
    assert not check.equal and check.histogram_diff == {"aten::relu": [1, 2]}
    assert check.first_divergence["index"] == 3
    assert check.first_divergence["real"] == "(the real run ends)"
    assert check.first_divergence["fake"].startswith("node 14 aten::relu")
