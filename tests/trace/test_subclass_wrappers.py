"""Tensor-subclass wrappers in a trace: a composite op's frames under its nested ops are kept in
its place, and the wrappers' shared storage id holds no memory (actors/trace/subclass_wrappers.py).

The hand-written nodes follow a real pipeline x tensor-parallel capture (gloo, torch 2.13): every
DTensor on storage id 50, ``linear`` running ``t`` and ``mm`` whose ``PythonSubclass`` frames run
the local ops, then a ``to`` of the DTensor logits (to its own dtype: no frame) and a
``detach_`` (the pipeline schedule's, no frame either)."""
from __future__ import annotations

from actors.trace import compute_liveness, load_trace
from actors.trace.stats import trace_stats
from actors.trace.subclass_wrappers import add_tensor_storages, drop_wrapper_ops, \
    used_storages
from tests.support.et_json import node, step_node, tensor, tensor_list, write_trace

LINEAR = "aten::linear(Tensor input, Tensor weight, Tensor? bias=None) -> Tensor"
MM = "aten::mm(Tensor self, Tensor mat2) -> Tensor"
T = "aten::t(Tensor(a) self) -> Tensor(a)"
TO = ("aten::to.dtype(Tensor(a) self, ScalarType dtype, bool non_blocking=False, bool copy=False, "
      "MemoryFormat? memory_format=None) -> Tensor(a)")
DETACH_ = "aten::detach_(Tensor(a!) self) -> Tensor(a!)"
RELU = "aten::relu(Tensor self) -> Tensor"
CAT = "aten::cat(Tensor[] tensors, int dim=0) -> Tensor"
WRAPPER = 50  # the storage id every wrapper shows
LOGITS = 4096  # the global logits' elements (the largest wrapper)


def _wrapped(tid, numel):
    return tensor(tid, WRAPPER, numel)


def _nodes(local_input=21):
    """A step: a plain relu making the local input, the DTensor linear (a composite op: its
    frames under its nested t and mm), then to and detach_ on the wrapper logits."""
    return [
        step_node(3, 1),
        node(4, "aten::relu", parent=3, schema=RELU, inputs=[tensor(20, local_input, 256)],
             outputs=[tensor(21, 21, 256)]),
        node(10, "aten::linear", parent=3, schema=LINEAR,
             inputs=[_wrapped(30, 512), _wrapped(31, 1024)], outputs=[_wrapped(32, LOGITS)]),
        node(11, "aten::t", parent=10, schema=T, inputs=[_wrapped(31, 1024)],
             outputs=[_wrapped(33, 1024)]),
        node(12, "PythonSubclass", parent=11, inputs=[_wrapped(31, 1024)]),
        node(13, "aten::t", parent=12, schema=T, inputs=[tensor(22, 22, 512)],
             outputs=[tensor(23, 22, 512)]),
        node(14, "aten::mm", parent=10, schema=MM, inputs=[_wrapped(30, 512), _wrapped(33, 1024)],
             outputs=[_wrapped(32, LOGITS)]),
        node(15, "PythonSubclass", parent=14, inputs=[_wrapped(30, 512), _wrapped(33, 1024)]),
        node(16, "aten::mm", parent=15, schema=MM,
             inputs=[tensor(21, 21, 256), tensor(23, 22, 512)], outputs=[tensor(24, 24, 2048)]),
        node(17, "aten::to", parent=3, schema=TO, inputs=[_wrapped(32, LOGITS)],
             outputs=[_wrapped(32, LOGITS)]),
        node(18, "aten::detach_", parent=3, schema=DETACH_, inputs=[_wrapped(32, LOGITS)],
             outputs=[_wrapped(32, LOGITS)]),
        node(19, "aten::relu", parent=3, schema=RELU, inputs=[tensor(24, 24, 2048)],
             outputs=[tensor(25, 25, 2048)]),
        # an empty tensor is written on the null pointer's id too: a real op, kept
        node(26, "aten::cat", parent=3, schema=CAT,
             inputs=[tensor_list(tensor(25, 25, 2048), _wrapped(27, 0))],
             outputs=[tensor(28, 28, 2048)]),
    ]


def test_a_composite_op_is_its_frames_local_ops(tmp_path):
    trace = load_trace(write_trace(tmp_path, _nodes()))
    assert [(op.node_id, op.name) for op in trace.ops] == [
        (4, "aten::relu"), (13, "aten::t"), (16, "aten::mm"), (19, "aten::relu"),
        (26, "aten::cat")]
    assert trace.meta["num_wrapper_ops"] == 2  # to and detach_
    assert trace_stats(trace)["num_wrapper_ops"] == 2  # tracefleet-inspect names them


def test_the_wrappers_storage_holds_no_memory(tmp_path):
    trace = load_trace(write_trace(tmp_path, _nodes()))
    on_wrapper = [t.numel for op in trace.ops for t in op.input_tensors() + op.output_tensors()
                  if t.storage_id == WRAPPER]
    assert on_wrapper == [0]  # the cat's empty input
    live = compute_liveness(trace.ops, trace.num_storages)
    # the local mm's output and the relu's, then the relu's and the cat's: never the global
    # logits' 16 KiB
    assert live.lower_bound_bytes == (2048 + 2048) * 4


def test_a_plain_tensor_passed_to_a_frame_is_no_wrapper():
    """A plain tensor the subclass op was called with is used by its local ops: it stays."""
    top = [[{"id": 5}, 0, "", used_storages(([[1, 7, 0, 8, 4, "cpu"]], []))],
           [{"id": 6}, 0, "", used_storages(([[2, 9, 0, 8, 4, "cpu"]], []))]]
    # frames took storages 7 (plain: op 5 under a frame uses it) and 9 (a wrapper)
    assert drop_wrapper_ops(top, {7, 9}, {5}) == 1
    assert [entry[0]["id"] for entry in top] == [5]


def test_tensor_storages_read_tensors_and_tensor_lists_with_elements():
    out = set()
    add_tensor_storages([[1, 7, 0, 8, 4, "cpu"], [[2, 8, 0, 4, 4, "cuda:0"]], 3, "x",
                         [1, 2, 3, 4, 5, 6], [3, 9, 0, 0, 4, "cpu"]], out)
    assert out == {7, 8}


def test_a_fake_captures_marker_names_the_wrappers_id_where_no_frame_does(tmp_path):
    """On fake, a DTensor op on its fast path leaves no frame (torchao's low-bit AdamW
    ``detach``es each DTensor parameter): the capture's WRAPPER_STORAGE_OP names the id, by a
    zero-size tensor, and the ops on it are dropped; without the marker they stay, the id read
    as a tensor of the largest wrapper's size."""
    from actors.trace.conventions import WRAPPER_STORAGE_OP

    detach = "aten::detach(Tensor(a) self) -> Tensor(a)"
    ops = [node(7, "aten::relu", parent=3, schema=RELU, inputs=[tensor(20, 21, 256)],
                outputs=[tensor(21, 22, 256)]),
           node(8, "aten::detach", parent=3, schema=detach, inputs=[_wrapped(30, LOGITS)],
                outputs=[_wrapped(31, LOGITS)])]
    marker = node(6, WRAPPER_STORAGE_OP, parent=3,
                  schema=f"{WRAPPER_STORAGE_OP}(Tensor null) -> ()", inputs=[_wrapped(29, 0)])
    (tmp_path / "marked").mkdir()
    (tmp_path / "plain").mkdir()
    marked = load_trace(write_trace(tmp_path / "marked", [step_node(3, 1), marker, *ops]))
    plain = load_trace(write_trace(tmp_path / "plain", [step_node(3, 1), *ops]))
    assert [op.name for op in marked.ops] == ["aten::relu"]
    assert marked.meta["num_wrapper_ops"] == 1
    assert [op.name for op in plain.ops] == ["aten::relu", "aten::detach"]
