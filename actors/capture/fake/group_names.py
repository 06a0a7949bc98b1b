"""Process-group names in a trace of an N-D mesh: which group each ``c10d::*`` call ran on,
and the trace of one rank rewritten as another rank of the same role.

The ET observer writes a ``c10d::*`` op's ProcessGroup argument as ``"<Object>"``: with one
group (1-D data parallel) that is the world, but on a mesh FSDP's all-gathers run on the
``dp_shard`` group, HSDP's all-reduces on ``dp_replicate``, pipeline sends on ``pp``. The
capture's fake mode (:class:`GroupNamingFakeMode`) logs the group of every ``c10d`` op it
dispatches, in order, and :func:`name_c10d_groups` writes each name into its op's
ProcessGroup argument (a ``String`` the loader reads as the op's ``pg_name``, as functional
collectives carry theirs in ``group_name``).

Group names are global counters ("0", "1", ...): rank 0's tensor-parallel group is not rank
2's. :func:`rank_renamer` turns one rank's trace into another's of the same role by mapping every
group name through the groups' descriptions (``mesh_tp``, ``mesh_dp_shard``, ...: one group
per description per rank) and replacing the ``## process_group:init ##`` table.
"""
from __future__ import annotations

import orjson

from actors.capture.fake.fake_mode import CaptureFakeMode
from actors.errors import TracefleetError

PG_INIT = "## process_group:init ##"


class GroupNamingFakeMode(CaptureFakeMode):
    """The capture's fake mode, also logging ``(op name, group name)`` of every c10d op."""

    def __init__(self):
        super().__init__()
        self.group_log: list[tuple[str, str]] = []

    def dispatch(self, func, types, args=(), kwargs=None):
        """CaptureFakeMode's, after logging a c10d op's group (here rather than in
        ``__torch_dispatch__``: the metadata queries answered there never reach it)."""
        if func.namespace == "c10d":
            name = _group_name(args)
            if name is not None:
                self.group_log.append((f"c10d::{func._opname}", name))
        return super().dispatch(func, types, args, kwargs)


def _group_name(args) -> str | None:
    import torch
    from torch._C._distributed_c10d import ProcessGroup

    for a in args:
        if isinstance(a, torch.ScriptObject):
            try:
                return ProcessGroup.unbox(a).group_name
            except RuntimeError:  # another custom class (ReduceOp, Work)
                continue
    return None


def _group_arg(schema: str) -> int | None:
    """Index of the ProcessGroup argument in a c10d op schema, None without one."""
    inside = schema[schema.index("(") + 1:schema.rindex(") ->")]
    for i, arg in enumerate(inside.split(", ")):
        if "c10d.ProcessGroup" in arg:
            return i
    return None


def _schema(node: dict) -> str:
    return next((a["value"] for a in node.get("attrs", ()) if a["name"] == "op_schema"), "")


def name_c10d_groups(doc: dict, group_log: list[tuple[str, str]], where: str) -> int:
    """Write the logged group names into ``doc``'s c10d ops (in execution order, matched by
    op name); returns how many calls. A call that a Python dispatch mode above the fake one
    passed on (selective activation checkpointing's, when FSDP2 all-gathers a unit nested in
    a checkpointed block) is two nodes, the call and its re-dispatch inside it: both get the
    one logged name. TracefleetError when the log and the trace disagree."""
    nodes = sorted((n for n in doc["nodes"] if n["name"].startswith("c10d::")
                    and _group_arg(_schema(n)) is not None), key=lambda n: n["id"])
    by_id = {n["id"]: n for n in doc["nodes"]}
    calls: list[list[dict]] = []  # each call's nodes: the outermost first
    outer_call: dict[int, list[dict]] = {}
    for node in nodes:
        outer = _enclosing_c10d(node, by_id)
        if outer is not None and outer["name"] == node["name"] and outer["id"] in outer_call:
            outer_call[outer["id"]].append(node)
            outer_call[node["id"]] = outer_call[outer["id"]]
            continue
        calls.append([node])
        outer_call[node["id"]] = calls[-1]
    if len(calls) != len(group_log):
        raise TracefleetError(f"{where}: the trace holds {len(calls)} c10d collectives with a "
                              f"process group, the capture dispatched {len(group_log)}")
    for call, (op, name) in zip(calls, group_log):
        for node in call:
            _write_group(node, op, name, where)
    return len(calls)


def _enclosing_c10d(node: dict, by_id: dict) -> dict | None:
    """The nearest c10d op enclosing ``node`` (None at the top: the trace's root node is its
    own parent)."""
    child, parent = node, by_id.get(node.get("ctrl_deps"))
    for _ in range(len(by_id)):  # a bound, should a malformed trace's parents loop
        if parent is None or parent is child:
            return None
        if parent["name"].startswith("c10d::"):
            return parent
        child, parent = parent, by_id.get(parent.get("ctrl_deps"))
    return None


def _write_group(node: dict, op: str, name: str, where: str) -> None:
    if node["name"] != op:
        raise TracefleetError(f"{where}: node {node['id']} {node['name']} was dispatched as "
                              f"{op}: the group log does not follow the trace")
    i = _group_arg(_schema(node))
    inputs = node["inputs"]
    if inputs["types"][i] != "Object":
        raise TracefleetError(f"{where}: node {node['id']} {node['name']}: argument {i} is "
                              f"a {inputs['types'][i]}, not the ProcessGroup object")
    inputs["values"][i], inputs["types"][i] = name, "String"


def group_table(nodes) -> list[dict]:
    """The ``## process_group:init ##`` table among a trace's ``nodes`` ([] without one)."""
    for node in nodes:
        if node["name"] == PG_INIT:
            return orjson.loads(node["inputs"]["values"][0])
    return []


def rename_map(source: list[dict], target: list[dict], where: str) -> dict[str, str]:
    """``{source group name: target group name}``, groups paired by their description."""
    def by_desc(table, who):
        out = {}
        for g in table:
            if g["pg_desc"] in out:
                raise TracefleetError(f"{where}: {who}'s process groups {out[g['pg_desc']]!r} "
                                      f"and {g['pg_name']!r} share the description "
                                      f"{g['pg_desc']!r}: they cannot be told apart")
            out[g["pg_desc"]] = g["pg_name"]
        return out

    src, dst = by_desc(source, "the recorded rank"), by_desc(target, "the target rank")
    if set(src) != set(dst):
        raise TracefleetError(f"{where}: the recorded rank's groups {sorted(src)} are not the "
                              f"target rank's {sorted(dst)}")
    return {src[d]: dst[d] for d in src}


def rank_renamer(table: list[dict], target_table: list[dict], where: str):
    """A node of the rank whose process-group table is ``table`` -> the same node (left
    unchanged) of the rank whose table is ``target_table``: every group name mapped, the table
    replaced."""
    names = rename_map(table, target_table, where)
    return lambda node: _renamed(node, names, target_table)


def _renamed(node: dict, names: dict[str, str], table: list[dict]) -> dict:
    name = node["name"]
    if name == PG_INIT:
        values = list(node["inputs"]["values"])
        values[0] = orjson.dumps(table).decode()
        return {**node, "inputs": {**node["inputs"], "values": values}}
    if not (name.startswith("c10d::") or name.startswith("_c10d_functional::")):
        return node
    inputs = node["inputs"]
    values = [names.get(v, v) if t == "String" and isinstance(v, str) else v
              for v, t in zip(inputs["values"], inputs["types"])]
    return {**node, "inputs": {**inputs, "values": values}}
