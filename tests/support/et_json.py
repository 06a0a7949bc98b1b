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


def step_node(nid, k, parent=2):
    """A ``ProfilerStep#k`` record_function range."""
    return node(nid, f"ProfilerStep#{k}", parent=parent)


def write_trace(tmp_path, nodes, schema="1.1.1-chakra.0.0.4", name="t.json"):
    """Write a trace with the process/thread roots; ``schema`` 1.0.1 takes flat nodes."""
    path = tmp_path / name
    roots = FLAT_ROOTS if schema.startswith("1.0.1") else ROOTS
    # Reversed: the observer writes nodes on op exit, so file order is not id order.
    path.write_bytes(orjson.dumps({"schema": schema, "pid": 1, "time": "x",
                                   "nodes": list(reversed(roots + nodes))}))
    return path
