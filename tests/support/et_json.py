"""Hand-written Execution Trace JSON for tests (torch-free): nodes, tensors, whole files.

``node()`` writes the nested 1.0.2+ layout, ``flat_node()`` the 1.0.1 one (``parent``,
``inputs``, ``input_shapes``, ``input_types``, op fields at the top level).
"""
from __future__ import annotations

import orjson

_ITEMSIZE = {"float": 4, "double": 8, "long int": 8, "int": 4, "c10::Half": 2}

EMPTY = "aten::empty.memory_format(SymInt[] size, *, ScalarType? dtype=None) -> Tensor"
VIEW = "aten::view(Tensor(a) self, SymInt[] size) -> Tensor(a)"
ADD = "aten::add.Tensor(Tensor self, Tensor other, *, Scalar alpha=1) -> Tensor"
ADD_ = "aten::add_.Tensor(Tensor(a!) self, Tensor other, *, Scalar alpha=1) -> Tensor(a!)"
RELU = "aten::relu(Tensor self) -> Tensor"
ONES = "aten::ones(SymInt[] size, *, ScalarType? dtype=None) -> Tensor"
CLONE = "aten::clone(Tensor self, *, MemoryFormat? memory_format=None) -> Tensor"
EMBEDDING = "aten::embedding(Tensor weight, Tensor indices, SymInt padding_idx=-1) -> Tensor"
ALLGATHER_BASE = ("c10d::_allgather_base_(Tensor output_tensor, Tensor input_tensor, "
                  "__torch__.torch.classes.c10d.ProcessGroup process_group, bool async_op=True, "
                  "int timeout=-1) -> (Tensor, __torch__.torch.classes.c10d.Work)")
FUNC_ALL_GATHER = ("_c10d_functional::all_gather_into_tensor(Tensor input, int group_size, "
                   "str group_name) -> Tensor")
FUNC_WAIT = "_c10d_functional::wait_tensor(Tensor tensor) -> Tensor"
BROADCAST = ("c10d::broadcast_(Tensor[] tensors, __torch__.torch.classes.c10d.ProcessGroup "
             "process_group, int root_rank, int root_tensor, bool asyncOp, int timeout=-1) -> "
             "(Tensor[], __torch__.torch.classes.c10d.Work)")
FLATTEN = "aten::flatten_dense_tensors(Tensor[] tensors) -> Tensor"
PROCESS_ROOT = "[pytorch|profiler|execution_trace|process]"
THREAD_ROOT = "[pytorch|profiler|execution_trace|thread]"


def tensor(tid, sid, numel, dtype="float", offset=0, shape=None, itemsize=None):
    """(value, shape, type) of one tensor argument."""
    size = itemsize or _ITEMSIZE[dtype]
    return ([tid, sid, offset, numel, size, "cpu"], shape or [numel], f"Tensor({dtype})")


def tensor_list(*tensors):
    """(value, shapes, type) of a ``Tensor[]`` argument."""
    inner = ",".join(t[2] for t in tensors)
    return ([t[0] for t in tensors], [t[1] for t in tensors], f"GenericList[{inner}]")


def scalar(value, type_str="Int"):
    return (value, [], type_str)


def side(args):
    return {"values": [a[0] for a in args], "shapes": [a[1] for a in args],
            "types": [a[2] for a in args], "strides": [[1] if a[2].startswith("Tensor") else []
                                                        for a in args]}


def node(nid, name, parent=2, inputs=(), outputs=(), schema="", **attrs):
    """A 1.0.2+ node; extra keyword arguments become string attrs."""
    attr_list = [{"name": "rf_id", "type": "uint64", "value": nid},
                 {"name": "op_schema", "type": "string", "value": schema}]
    attr_list += [{"name": k, "type": "string", "value": v} for k, v in attrs.items()]
    return {"id": nid, "name": name, "ctrl_deps": parent, "inputs": side(inputs),
            "outputs": side(outputs), "attrs": attr_list}


def flat_node(nid, name, parent=2, inputs=(), outputs=(), schema=""):
    """A schema 1.0.1 node."""
    return {"id": nid, "name": name, "parent": parent, "op_schema": schema,
            "inputs": [a[0] for a in inputs], "input_shapes": [a[1] for a in inputs],
            "input_types": [a[2] for a in inputs], "outputs": [a[0] for a in outputs],
            "output_shapes": [a[1] for a in outputs], "output_types": [a[2] for a in outputs]}


ROOTS = [node(1, PROCESS_ROOT, parent=1), node(2, THREAD_ROOT, parent=1)]
FLAT_ROOTS = [flat_node(1, PROCESS_ROOT, parent=1), flat_node(2, THREAD_ROOT, parent=1)]


def broadcast_node(nid, t, parent=2, dtype="float"):
    """A gloo-shaped c10d::broadcast_ of tensor id/storage ``t`` (8 elements) from root 0."""
    return node(nid, "c10d::broadcast_", parent=parent, schema=BROADCAST,
                inputs=[tensor_list(tensor(t, t, 8, dtype)), scalar("<Object>", "Object"),
                        scalar(0), scalar(0), scalar(False, "Bool"), scalar(-1)],
                outputs=[tensor_list(tensor(t, t, 8, dtype))])


def step_node(nid, k, parent=2):
    """A ``ProfilerStep#k`` record_function range."""
    return node(nid, f"ProfilerStep#{k}", parent=parent)


def write_trace(tmp_path, nodes, schema="1.1.1-chakra.0.0.4", name="t.json"):
    """Write a trace with the process/thread roots; ``schema`` 1.0.1 takes flat nodes. The
    nodes are written in the order they would close (`close_order`)."""
    path = tmp_path / name
    flat = schema.startswith("1.0.1")
    roots = FLAT_ROOTS if flat else ROOTS
    path.write_bytes(orjson.dumps({"schema": schema, "pid": 1, "time": "x",
                                   "nodes": close_order(roots + nodes, flat)}))
    return path


def close_order(nodes: list, flat: bool = False) -> list:
    """``nodes`` as the observer writes them, each when it closes: children before their
    parent, siblings by id (the tree their parent links draw); nodes no root reaches (a parent
    cycle) last. Malformed nodes (no id, no parent, a repeated id) are kept."""
    key = "parent" if flat else "ctrl_deps"
    ids = {n.get("id") for n in nodes}
    children: dict[object, list[int]] = {}
    tops = []
    ids = {i for i in ids if type(i) is int}
    for i in sorted(range(len(nodes)), key=lambda i: _int_or(nodes[i].get("id"))):
        parent = nodes[i].get(key)
        inside = type(parent) is int and parent in ids and parent != nodes[i].get("id")
        (children.setdefault(parent, []) if inside else tops).append(i)
    out, seen = [], set()
    todo = [(i, False) for i in reversed(tops)]
    while todo:
        i, done = todo.pop()
        if done:
            out.append(i)
        elif i not in seen:
            seen.add(i)
            todo.append((i, True))
            todo += [(c, False) for c in reversed(children.get(nodes[i].get("id"), []))]
    order = out + [i for i in reversed(range(len(nodes))) if i not in seen]
    return [nodes[i] for i in order]


def _int_or(value, default: int = -1) -> int:
    return value if type(value) is int else default
