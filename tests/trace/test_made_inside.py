"""Storages a composite op makes inside itself and a later op reads (actors/trace/made_inside.py):
not alive before the iteration, so ``faithful`` does not keep them across iterations."""
from __future__ import annotations

from actors.replay.memory.policies import make_policy
from actors.trace import compute_liveness, load_trace
from actors.trace.stats import param_like_storages
from orchestrator.config import DEMO_TRACES
from tests.support.et_json import ADD, ADD_, EMPTY, RELU, node, step_node, tensor, write_trace

DEMO = DEMO_TRACES


def _suid(trace, storage_id):
    return next(t.suid for op in trace.ops for t in op.input_tensors() + op.output_tensors()
                if t.storage_id == storage_id)


def _trace(tmp_path):
    """Before the step, a set-up op whose nested node makes storage 50. In the step: relu
    (node 11) makes storage 7 inside itself (a saved intermediate) and writes storage 40 in
    place inside itself; add (node 14) then reads 7, the parameter 9, 40 and 50, first seen
    there."""
    x, param, inplace, early = tensor(1, 1, 4), tensor(9, 9, 4), tensor(40, 40, 4), tensor(50, 50, 4)
    saved = tensor(7, 7, 4)
    nodes = [node(5, "aten::relu", inputs=[x], outputs=[tensor(3, 3, 4)], schema=RELU),
             node(6, "aten::empty", parent=5, outputs=[early], schema=EMPTY),
             step_node(10, 1),
             node(11, "aten::relu", parent=10, inputs=[x], outputs=[tensor(2, 2, 4)], schema=RELU),
             node(12, "aten::empty", parent=11, outputs=[saved], schema=EMPTY),
             node(13, "aten::add_", parent=11, inputs=[inplace, x], outputs=[inplace], schema=ADD_),
             node(14, "aten::add", parent=10, inputs=[saved, param], outputs=[tensor(8, 8, 4)],
                  schema=ADD),
             node(15, "aten::add", parent=10, inputs=[inplace, early], outputs=[tensor(11, 11, 4)],
                  schema=ADD)]
    return load_trace(write_trace(tmp_path, nodes))


def test_only_a_nested_new_allocation_in_the_iteration_counts(tmp_path):
    trace = _trace(tmp_path)
    assert [op.name for op in trace.ops] == ["aten::relu", "aten::add", "aten::add"]
    # the saved intermediate only; not the parameter, the buffer written in place inside
    # an op, nor what a nested op made before the step began
    assert trace.made_inside == {_suid(trace, 7)}


def test_faithful_keeps_parameters_but_not_what_the_iteration_made(tmp_path):
    trace = _trace(tmp_path)
    live = compute_liveness(trace.ops, trace.num_storages)
    used = set(range(trace.num_storages))
    saved, param = _suid(trace, 7), _suid(trace, 9)
    faithful = make_policy("faithful", live, used, set(), trace.made_inside)
    assert param in faithful.persistent and saved not in faithful.persistent
    assert saved in faithful.free_lists[live.storage_last[saved]]  # freed at its last use
    pre = make_policy("pre_allocate", live, used, set(), trace.made_inside)
    assert {param, saved} <= pre.persistent  # the reference replayer's rule, unchanged


def test_a_reused_storage_id_belongs_to_the_tensor_after_its_last_use(tmp_path):
    """Storage id 7 is read at node 11 (the batch), then the allocator hands it to a tensor a
    nested op makes (node 13); the next top-level op that reads it sees that new tensor."""
    batch = tensor(7, 7, 4)
    nodes = [step_node(10, 1),
             node(11, "aten::relu", parent=10, inputs=[batch], outputs=[tensor(2, 2, 4)],
                  schema=RELU),
             node(12, "aten::relu", parent=10, inputs=[tensor(2, 2, 4)],
                  outputs=[tensor(3, 3, 4)], schema=RELU),
             node(13, "aten::empty", parent=12, outputs=[tensor(17, 7, 4, dtype="long int")],
                  schema=EMPTY),
             node(14, "aten::relu", parent=10, inputs=[tensor(17, 7, 4, dtype="long int")],
                  outputs=[tensor(4, 4, 4)], schema=RELU)]
    trace = load_trace(write_trace(tmp_path, nodes))
    first, second = trace.ops[0].inputs[0].suid, trace.ops[2].inputs[0].suid
    assert first != second and trace.made_inside == {second}


def test_demo_loss_intermediate_is_made_inside_and_no_parameter_is(tmp_path):
    """A real capture: cross_entropy keeps the log_softmax that nll_loss_backward reads first."""
    trace = load_trace(DEMO / "gpt_dp_4" / "rank-0.et.json.gz")
    live = compute_liveness(trace.ops, trace.num_storages)
    loss_grad = next(op for op in trace.ops if op.name == "aten::nll_loss_backward")
    log_probs = loss_grad.inputs[1].suid
    assert live.storage_external[log_probs] and log_probs in trace.made_inside
    params = set(param_like_storages(trace, live.storage_external))
    assert params and not params & trace.made_inside
