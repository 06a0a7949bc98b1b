"""Parent links a backend's thread made wrong are mended from the file order
(actors/trace/parent_links.py): the shapes seen in real gloo captures, written in the order the
observer wrote them there."""
from __future__ import annotations

import orjson

from actors.trace import load_trace
from actors.trace.parent_links import file_order, mend_parent_links
from tests.support.et_json import ALLGATHER_BASE, CLONE, FLATTEN, ROOTS, VIEW, broadcast_node, \
    close_order, node, scalar, tensor, tensor_list, write_trace

CAT = "aten::cat(Tensor[] tensors, int dim=0) -> Tensor"


def _write(tmp_path, nodes_in_file_order):
    path = tmp_path / "t.json"
    path.write_bytes(orjson.dumps({"schema": "1.1.1-chakra.0.0.4", "pid": 1, "time": "x",
                                   "nodes": nodes_in_file_order + ROOTS[::-1]}))
    return path


def _flatten(nid, parent, t):
    return node(nid, "aten::flatten_dense_tensors", parent=parent, schema=FLATTEN,
                inputs=[tensor_list(tensor(t, t, 8))], outputs=[tensor(t + 1, t + 1, 8)])


def _cat(nid, parent, t):
    return node(nid, "aten::cat", parent=parent, schema=CAT,
                inputs=[tensor_list(tensor(t, t, 8)), scalar(0)], outputs=[tensor(t + 1, t + 1, 8)])


def _ddp_broadcast(flatten_parent, cat_parent):
    """DDP's two buffer buckets in a forward: flatten, broadcast, flatten again; the second
    flatten and its cat recorded under the given parents (a ``gloo:broadcast`` range, 9, that
    opened after the second flatten on gloo's thread and closed before it)."""
    return [node(3, "DistributedDataParallel.forward"), _flatten(4, 3, 10), _cat(5, 4, 10),
            broadcast_node(6, 11, parent=3), _flatten(7, flatten_parent, 20),
            _cat(8, cat_parent, 20),
            node(9, "gloo:broadcast", parent=3)]


def test_ops_gathered_by_a_gloo_range_are_given_back_to_the_op_that_ran_them(tmp_path):
    # the file order of the real capture: the range closed first, then the cat, the flatten
    written = {n["id"]: n for n in _ddp_broadcast(flatten_parent=9, cat_parent=9)}
    trace = load_trace(_write(tmp_path, [written[i] for i in (5, 4, 6, 9, 8, 7, 3)]))
    assert [op.name for op in trace.ops] == ["aten::flatten_dense_tensors", "c10d::broadcast_",
                                             "aten::flatten_dense_tensors"]
    # the same step as the observer writes it when gloo's thread keeps out of the way
    clean = load_trace(write_trace(tmp_path, _ddp_broadcast(flatten_parent=3, cat_parent=7),
                                   name="clean.json"))
    assert [(op.node_id, op.name, op.module) for op in trace.ops] == \
        [(op.node_id, op.name, op.module) for op in clean.ops]


def test_op_under_a_collective_that_had_returned_is_a_top_level_op(tmp_path):
    """The bundled ZeRO-3 demo, one rank of two: the ``narrow``/``view`` of an all-gather's
    output, run after the async ``_allgather_base_`` returned, recorded under it."""
    gather = node(4, "c10d::_allgather_base_", parent=3, schema=ALLGATHER_BASE,
                  inputs=[tensor(20, 20, 16), tensor(10, 10, 8), scalar("<Object>", "Object"),
                          scalar(True, "Bool"), scalar(-1)],
                  outputs=[tensor(20, 20, 16), scalar("<Object>", "Object")])
    view = node(6, "aten::view", parent=4, schema=VIEW,
                inputs=[tensor(20, 20, 16), scalar([4, 4], "GenericList[Int,Int]")],
                outputs=[tensor(21, 20, 16, shape=[4, 4])])
    clone = node(7, "aten::clone", parent=3, schema=CLONE, inputs=[tensor(21, 20, 16)],
                 outputs=[tensor(22, 22, 16)])
    gloo = node(5, "gloo:all_gather", parent=4)
    trace = load_trace(_write(tmp_path, [gloo, gather, view, clone, node(3, "Embedding.forward")]))
    assert [(op.name, op.module) for op in trace.ops] == \
        [("c10d::_allgather_base_", "Embedding.forward"), ("aten::view", "Embedding.forward"),
         ("aten::clone", "Embedding.forward")]


def test_links_are_left_alone_where_no_backend_ran(tmp_path):
    """No backend range: no positions taken, nothing mended (the observer's links are kept,
    even one to an op written earlier)."""
    nodes = close_order(ROOTS + [node(3, "aten::relu"), node(4, "aten::relu", parent=3)])
    assert file_order(nodes) is None
    with_backend = nodes + [node(5, "gloo:all_reduce")]
    position = file_order(with_backend)
    assert position[4] < position[3] < position[1]
    assert mend_parent_links(sorted(with_backend, key=lambda n: n["id"]), False, position) == 0


def test_a_malformed_link_is_left_to_the_loader(tmp_path):
    """A parent of the wrong type in a trace with a backend range is named by the loader, as in
    one without."""
    bad = node(4, "aten::relu", parent=[3])
    nodes = sorted(ROOTS + [node(3, "x"), bad, node(5, "gloo:broadcast", parent=3)],
                   key=lambda n: n["id"])
    assert mend_parent_links(nodes, False, {n["id"]: i for i, n in enumerate(nodes)}) == 0
    assert bad["ctrl_deps"] == [3]
