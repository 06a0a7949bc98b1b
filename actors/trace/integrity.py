"""Checks of a trace's structure that its parse alone does not make, each a TraceError naming
the node: what the observer never writes, and what would otherwise replay silently wrong.

On the raw nodes (`check_nodes`, before the loader walks them):

* **node ids are unique**: the walk keys every node by id, so a second node with an id takes
  the first one's place (its children, its op);
* **parent links form a tree**: ids are handed out on op entry, so a parent's id is smaller
  than its children's; a chain of parent links that comes back to where it started (or a node
  that is its own parent, other than the process root) is a cycle, which the walk would read
  as top-level ops that the original ran nested (an op counted twice).

On the ops that replay (`check_ops`, after they are built):

* **a tensor's shape agrees with its element count**: the observer records both from the
  same tensor, so a shape whose product is not the tuple's ``numel`` (a huge or garbled
  shape) would make the replay build another tensor than the one recorded;
* **the recorded arguments agree with the op schema**: an argument the schema declares a
  ``Tensor`` recorded as a number or a list, or an ``int``/``float``/``bool`` one recorded as
  a tensor, cannot be the call that ran (the replay would skip the op with a dispatch error).

Pure trace code: no torch. Checked on every bundled demo, the public PARAM traces, a gloo
capture, a fake llama3_8b and a meta llama_70b capture: none of them trips a check.
"""
from __future__ import annotations

import math
from functools import lru_cache
from itertools import pairwise

from actors.errors import ReplayError, TraceError
from actors.trace.args import preview
from actors.trace.model import Op, TensorArg
from actors.trace.op_schema import parse_schema

_ROOT_PREFIX = "[pytorch|profiler|"  # the process root names itself as its parent
_MAX_SHOWN = 6  # ids of a cycle named in its message
_SCALARS = frozenset({"int", "SymInt", "float", "bool"})
_NOT_TENSORS = frozenset({"int", "float", "bool", "str", "int_list", "float_list", "bool_list",
                          "device"})


def check_nodes(path, nodes: list, flat: bool) -> None:
    """Unique ids and acyclic parent links in ``nodes`` (raw nodes, sorted by id); malformed
    nodes are left to the loader, which names them."""
    key = "parent" if flat else "ctrl_deps"
    ids = [n["id"] for n in nodes]  # the loader sorted them by it: each has one
    if len(set(ids)) != len(ids):
        a, b = next((a, b) for a, b in pairwise(nodes) if a["id"] == b["id"])
        raise TraceError(path, f"node id {a['id']} appears twice (as {_name(a)} and "
                               f"{_name(b)}); expected one node per id", a["id"])
    # A cycle needs a link to a larger id (links to smaller ids only descend): start there.
    upward = [n for n in nodes if type(n.get(key)) is int and n[key] >= n["id"]]
    parent = {n["id"]: n.get(key) for n in nodes} \
        if any(n[key] != n["id"] for n in upward) else None
    for node in upward:
        nid = node["id"]
        if node[key] != nid:
            _check_chain(path, nid, parent)
        elif not str(node.get("name", "")).startswith(_ROOT_PREFIX):
            raise TraceError(path, f"{_name(node)} is its own parent; only the process root "
                                   "may be", nid)


def _check_chain(path, start: int, parent: dict) -> None:
    """TraceError when following parent links from ``start`` comes back to it."""
    chain, nid = [start], parent.get(start)
    for _ in range(len(parent)):
        if nid == start:
            shown = " -> ".join(map(str, chain[:_MAX_SHOWN] + [start]))
            more = " ..." if len(chain) > _MAX_SHOWN else ""
            raise TraceError(path, f"parent links form a cycle ({shown}{more}); expected a tree "
                                   "under the process root", start)
        up = parent.get(nid)
        if type(nid) is not int or up is None or up == nid:  # a root, or off the trace
            return
        chain.append(nid)
        nid = up


def _name(node) -> str:
    return preview(node.get("name"), 40) if isinstance(node, dict) else preview(node, 40)


def check_ops(path, ops: list[Op]) -> None:
    """Shapes that agree with element counts, arguments that agree with the op schema."""
    numel = _numel
    for op in ops:
        for args in (op.inputs, op.outputs):
            for arg in args:
                if type(arg) is TensorArg:
                    if numel(arg.shape) != arg.numel:
                        _shape_error(path, op)
                elif arg.kind == "tensor_list":
                    for t in arg.value:
                        if t is not None and numel(t.shape) != t.numel:
                            _shape_error(path, op)
        if op.schema:
            _check_schema(path, op)


def _shape_error(path, op: Op) -> None:
    """The TraceError naming ``op``'s first tensor whose shape contradicts its numel."""
    for side, args in (("input", op.inputs), ("output", op.outputs)):
        for i, arg in enumerate(args):
            tensors = (arg,) if type(arg) is TensorArg else \
                arg.value if arg.kind == "tensor_list" else ()
            for t in tensors:
                if t is not None and _numel(t.shape) != t.numel:
                    raise TraceError(path, f"{op.name} {side} #{i}: shape "
                                           f"{preview(list(t.shape))} holds "
                                           f"{_numel(t.shape):,} elements, its tensor value "
                                           f"records numel {t.numel:,}; expected them to agree",
                                     op.node_id)


def _check_schema(path, op: Op) -> None:
    tensors, scalars = _expected_kinds(op.schema)
    inputs = op.inputs
    for i in tensors:
        if i < len(inputs) and type(inputs[i]) is not TensorArg \
                and inputs[i].kind in _NOT_TENSORS:
            _schema_error(path, op, i)
    for i in scalars:
        if i < len(inputs) and type(inputs[i]) is TensorArg:
            _schema_error(path, op, i)


def _schema_error(path, op: Op, i: int) -> None:
    arg, want = op.inputs[i], parse_schema(op.schema).args[i].type
    got = "a tensor" if type(arg) is TensorArg else \
        f"{arg.type_str or arg.kind} {preview(arg.value, 40)}"
    raise TraceError(path, f"{op.name} input #{i}: the op schema takes a {want}, the trace "
                           f"records {got}; expected the recorded types to match the schema",
                     op.node_id)


@lru_cache(maxsize=1 << 16)
def _numel(shape: tuple) -> int:
    return math.prod(shape)


@lru_cache(maxsize=8192)
def _expected_kinds(schema: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Positions of the arguments `check_ops` checks: ``(plain Tensor ones, scalar ones)``
    (none for a schema that does not parse or takes varargs)."""
    try:
        parsed = parse_schema(schema)
    except ReplayError:
        return (), ()
    if parsed.is_vararg:
        return (), ()
    return (tuple(i for i, a in enumerate(parsed.args) if a.type == "Tensor"),
            tuple(i for i, a in enumerate(parsed.args) if a.type in _SCALARS))
