"""Load one rank's Execution Trace (``.json`` / ``.json.gz``, a file or an archive member)
into the compact `Trace` model.

Only top-level operators are kept: an op (a node with an op schema, or a
``record_param_comms`` node) whose ancestors contain no other op. Annotation nodes
(``record_function`` ranges, autograd engine frames, ``ProfilerStep#N``) are transparent;
they only contribute the enclosing module name and step window.

The observer's parent links are not reliable around collectives (see DESIGN.md): a
collective can be recorded under the previous collective, or under an unrelated op that
ran around it, on one rank only. Collectives do not call collectives, and no operator
calls one, so a collective (``c10d::*``, ``_c10d_functional::*``, ``record_param_comms``)
is its own op wherever it is recorded, with two exceptions: the ``record_param_comms``
record of a ``c10d::*`` op (its first such child) completes that op, and a ``c10d::*`` op
(or a ``record_param_comms``) under a functional collective is how eager functional
collectives do their work. Backend nodes (``gloo:*``, ``nccl:*``) are neither ops nor
module names: their children are treated as children of the backend node's parent. Before any
of this, links that a backend's thread made wrong (an op under a range of another thread, or
under an op that had closed) are mended from the file's order (parent_links.py).

Tensor subclasses: an op on wrapper tensors (DTensor: FSDP2's sharded parameters, gradients
and optimizer state) is recorded with the wrappers, which have no storage of their own (every
DTensor shows one shared storage id), and a ``PythonSubclass`` child holding the ops the
subclass ran on its local tensors. Those ops are the real work and the real memory: the
wrapper op is dropped and the ops under ``PythonSubclass`` are top-level in its place.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from functools import lru_cache

import orjson

from actors.errors import ReplayError, TraceError
from actors.gc_pause import gc_paused
from actors.trace import collectives as coll
from actors.trace import integrity, parent_links
from actors.trace.archive import rank_from_name
from actors.trace.host_scalars import mark_host_scalars
from actors.trace.made_inside import NestedAllocations, storages_made_inside, tensor_storage_ids
from actors.trace.nested_lifetimes import nested_lifetimes
from actors.trace.node_stream import TraceNodes, over_nodes
from actors.trace.conventions import FREED_OP, HOST_STORAGE_OP, MODULE_BWD_BEGIN_PREFIX, \
    MODULE_BWD_END_PREFIX, WRAPPER_STORAGE_OP, parse_module_range
from actors.trace.recorded_frees import free_positions, freed_storages, made_in_step
from actors.trace.args import ArgParser, preview
from actors.trace.model import MAX_WORLD_SIZE, Op, ProcessGroupInfo, Step, Trace
from actors.trace.op_schema import parse_schema
from actors.trace.parsed_cache import cached_load
from actors.trace.schema import NodeView, OpSchemaReader, parse_version
from actors.trace.source import TraceSource, as_source
from actors.trace.subclass_wrappers import add_tensor_storages, drop_wrapper_ops, \
    used_storages
from actors.trace.tensor_ids import UNIQUE_STORAGES_KEY, TensorIdAssigner, refill_starts

PG_INIT = "## process_group:init ##"
SUBCLASS = "PythonSubclass"  # a tensor subclass's dispatch (see the module docstring)
STEP_PREFIX = "ProfilerStep#"
# Annotation frames that are not module boundaries.
_NOT_MODULE = ("[pytorch|profiler", "autograd::engine", STEP_PREFIX, "## process_group",
               "PythonDispatchMode")  # the frame of a Python dispatch mode (selective AC)
_BACKWARD_MARKERS = (MODULE_BWD_BEGIN_PREFIX, MODULE_BWD_END_PREFIX)  # conventions.py
_MAX_BACKEND_HOPS = 64  # backend nodes chained under backend nodes (bounds a parent cycle)
# What encloses a node: no op, some op, or a functional collective (which calls c10d ops).
_FREE, _IN_OP, _IN_FUNCTIONAL = 0, 1, 2
_NO_CONTEXT = (_FREE, -1, "")  # a node at the top, or one whose parent was never written


@lru_cache(maxsize=4096)
def _schema_arg_names(schema: str) -> tuple[str, ...]:
    """Argument names of an op schema, in order (() when it does not parse)."""
    try:
        return tuple(a.name for a in parse_schema(schema).args)
    except ReplayError:
        return ()


def load_trace(path, rank: int | None = None, data: bytes | None = None) -> Trace:
    """Load and validate one rank's trace into a `Trace`.

    ``path``: a file or a `TraceSource`; ``data``: its stored bytes if they came another way.
    ``rank`` defaults to the rank in the file or member name (`actors.trace.archive`). A source
    with a ``parsed_cache_dir`` reads a large trace loaded before from there
    (actors/trace/parsed_cache.py).
    """
    source = as_source(path)
    # Parsing and building create millions of small containers, none in a reference cycle;
    # left on, the cyclic GC rescans the growing heap over and over (2-3x the load time).
    with gc_paused():
        if data is not None:  # bytes shipped from the driver: no file to key a cache by
            return _load_trace(source, rank, data)
        return cached_load(source, rank, lambda: _load_trace(source, rank, None))


def _load_trace(source: TraceSource, rank: int | None, data: bytes | None) -> Trace:
    return over_nodes(source, lambda read: _build_trace(source, read, rank), data)


def _build_trace(source: TraceSource, read: TraceNodes, rank: int | None) -> Trace:
    doc, nodes = read.header, read.nodes
    path = str(source)
    version = parse_version(path, doc.get("schema"))
    flat = version < (1, 0, 2)
    num_nodes = len(nodes)
    position = parent_links.file_order(nodes)  # before the sort: the order they closed
    try:
        nodes.sort(key=lambda n: n["id"])
    except (KeyError, TypeError):
        bad = next((n for n in nodes if not isinstance(n, dict) or not isinstance(n.get("id"), int)), None)
        raise TraceError(path, f"a node has no integer 'id' (node starts {preview(bad, 80)})") from None
    integrity.check_nodes(path, nodes, flat)  # unique ids, no parent cycle
    if position is not None:
        parent_links.mend_parent_links(nodes, flat, position)
    built = _build_ops(path, nodes, read.full, flat)
    read.release()
    ops, nested = built.ops, built.nested
    integrity.check_ops(path, ops)  # shapes agree with numel, arguments with the op schema
    num_host_scalars = mark_host_scalars(ops)  # Python numbers: no storage (host_scalars.py)
    # meta and fake captures never hand an address out twice (meta: every tensor says so)
    unique = doc.get(UNIQUE_STORAGES_KEY) is True or next(
        (t.device == "meta" for op in ops for t in op.input_tensors()), False)
    assigner = TensorIdAssigner(refill_starts(ops), nested.by_storage, unique_storages=unique)
    freed_after = free_positions(built.freed_marks, [op.node_id for op in ops])
    recorded_frees = []
    for op in ops:
        assigner.assign(op)
        for storage_id, made in freed_after.get(op.index, ()):
            suid = assigner.current_suid(storage_id)
            if suid is not None:
                recorded_frees.append((suid, op.index, made))
    coll.link_waits(ops)
    host = built.host_storage_ids
    host_storages = frozenset(t.suid for op in ops for t in op.input_tensors()
                              if t.storage_id in host and t.suid >= 0) if host else frozenset()
    made = storages_made_inside(ops, nested, built.step_first_ids)
    return Trace(path=str(path), schema=doc["schema"], num_nodes=num_nodes, ops=ops,
                 process_groups=built.pgs, steps=built.steps, num_tensors=assigner.num_tensors,
                 num_storages=assigner.num_storages,
                 made_inside=frozenset(made) | frozenset(assigner.refilled)
                 | made_in_step(tuple(recorded_frees)),
                 nested_lifetimes=nested_lifetimes(ops, nested, made, assigner.unique),
                 recorded_frees=tuple(recorded_frees), host_storages=host_storages,
                 backward_marks=_backward_marks(built.backward_marks, ops),
                 rank=rank if rank is not None else rank_from_name(source.name),
                 meta={"pid": doc.get("pid"), "time": doc.get("time"),
                       "num_dropped_ops": built.num_dropped,
                       "dropped_ops": built.dropped_ops,
                       "num_orphan_ops": built.num_orphans,
                       "num_wrapper_ops": built.num_wrapper_ops,
                       "num_recorded_frees": len(recorded_frees),
                       "num_host_scalars": num_host_scalars})


@dataclass
class _Built:
    """What ``_build_ops`` selected (see its docstring)."""

    ops: list[Op]
    pgs: list[ProcessGroupInfo]
    steps: list[Step]
    # top-level ops outside every ProfilerStep window, not replayed: how many, and per op
    # name [count, output bytes]
    num_dropped: int
    dropped_ops: dict
    # top-level ops under a range that was never written (it never closed: a forward that
    # raised), placed in the step window they ran in
    num_orphans: int
    nested: NestedAllocations
    step_first_ids: list[int]  # first node id of each step
    freed_marks: list  # (node id, storage ids, the node it was written at) of each FREED_OP
    host_storage_ids: set  # storage ids named by HOST_STORAGE_OP nodes
    backward_marks: list  # (node id, name) of each module backward marker, in id order
    # ops on tensor-subclass wrappers that ran no frame of the subclass: no work, no memory
    # (actors/trace/subclass_wrappers.py)
    num_wrapper_ops: int


def _build_ops(path, nodes: list, full, flat: bool) -> "_Built":
    """Select top-level ops in id order (``_select``), keep those inside the ProfilerStep
    windows (``_keep_in_steps``) and build them (``_make_ops``); nested allocations: see
    actors/trace/made_inside.py.

    ``nodes`` are the nodes in id order as `TraceNodes` holds them (``full`` returns a node's
    whole object): a whole object lives while its node is looked at, and a selected op's again
    while it is built, so the raw JSON and the model never peak together.
    """
    sel = _select(path, nodes, full, flat)
    top_level, num_orphans, dropped = _keep_in_steps(path, sel, full, flat)
    num_wrapper_ops = drop_wrapper_ops(top_level, sel.frame_inputs, sel.under_frame)
    ops, steps = _make_ops(path, top_level, sel, full, flat)
    return _Built(ops, sel.pgs, steps, sum(c for c, _ in dropped.values()), dropped, num_orphans,
                  sel.nested, [span[0] for span in sel.step_spans], sel.freed_marks,
                  sel.host_storage_ids, sel.backward_marks, num_wrapper_ops)


@dataclass
class _Selection:
    """What ``_select`` found: the top-level ops and what the later phases need of the rest."""

    # [node, step, module, used storages] per selected op, in id order (node: as `full` takes
    # it; the storages: subclass_wrappers.py's)
    top_level: list
    rpc_child: dict  # c10d op id -> its record_param_comms record
    step_names: list[str]
    step_spans: list[list[int]]  # [first id, last id] of each ProfilerStep subtree
    lost_ops: dict  # selected op id -> the never-written range above it (orphans)
    pgs: list[ProcessGroupInfo]
    nested: NestedAllocations
    freed_marks: list  # (node id, storage ids, the node it was written at) of each FREED_OP
    host_storage_ids: set  # storage ids named by HOST_STORAGE_OP nodes
    backward_marks: list  # (node id, name) of each module backward marker
    frame_inputs: set  # storage ids of the PythonSubclass frames' tensor inputs
    under_frame: set  # ids of the nodes under a PythonSubclass frame


def _select(path, nodes: list, full, flat: bool) -> _Selection:
    """The top-level ops (see the module docstring), their step window and module, and the
    process groups, nested allocations, recorded frees and backward markers on the way.

    A node whose parent was never written (a range that never closed: the observer writes a
    node when it exits, and a module forward that raised never exits its range) is an orphan:
    its ops are top-level ops of the step window they ran in, when that range opened inside the
    window (``_assign_steps``); the rest of the window's ops are untouched. ``nodes`` and
    ``full``: as `_build_ops` takes them.
    """
    sel = _Selection([], {}, [], [], {}, [], NestedAllocations(), [], set(), [], set(), set())
    top_level, rpc_child, step_spans, nested = sel.top_level, sel.rpc_child, sel.step_spans, \
        sel.nested
    # Per node id: (what encloses it, step index, module name). Parents precede children in
    # id order, except under backend nodes (resolved through ``backend_parent``).
    ctx: dict[int, tuple[int, int, str]] = {}
    backend_parent: dict[int, int] = {}
    selected: dict[int, list] = {}  # id -> entry of top_level, for ops selected outside any op
    c10d_calls: set[int] = set()  # ids of selected collective calls that may take such a record
    top_of: dict[int, int] = {}  # node id -> id of the selected op it runs inside
    lost: dict[int, int] = {}  # node id -> the never-written range above it (orphans)
    unwrapped: set[int] = set()  # ids of wrapper ops dropped for their subclass's local ops
    schema_of = OpSchemaReader(flat)
    prev = (0, 0)  # (id, parent) of the node before
    for node in nodes:
        raw = full(node)
        nid, name, parent, is_op = _fields(path, raw, flat, schema_of)
        if parent in backend_parent:
            parent = _above_backends(parent, backend_parent)
        before, prev = prev, (nid, parent)
        if parent in sel.under_frame:
            sel.under_frame.add(nid)
        if not is_op and name.startswith(parent_links.BACKEND_PREFIXES):
            backend_parent[nid] = parent
            continue
        entry = ctx.get(parent)
        if entry is None:
            entry = _NO_CONTEXT
            if 0 < parent != nid:
                lost[nid] = parent
        elif lost and parent in lost:
            lost[nid] = lost[parent]
        enclosing, step, module = entry
        if step >= 0:
            step_spans[step][1] = nid
        if name == FREED_OP:
            sel.freed_marks.append(_freed_mark(raw, flat, nid, parent, before))
            continue
        if name == HOST_STORAGE_OP:  # host copies a GPU target's step made
            sel.host_storage_ids.update(
                sid for sid, _ in freed_storages(NodeView(raw, flat).side("inputs")[0]))
            continue
        if name == WRAPPER_STORAGE_OP:  # the wrappers' id, named by a zero-size tensor
            tensor_storage_ids(_side_values(raw, flat)[0], sel.frame_inputs)
            continue
        if is_op:
            collective = name == "record_param_comms" or name in coll.C10D_KINDS
            if name == "record_param_comms" and parent in c10d_calls and parent not in rpc_child:
                rpc_child[parent] = raw
            elif enclosing == _FREE or (collective and (enclosing == _IN_OP
                                                        or name in coll.FUNCTIONAL)):
                top_level.append([node, step, module,
                                  used_storages(_side_values(raw, flat))])
                top_of[nid] = nid
                if enclosing == _FREE:
                    selected[nid] = top_level[-1]
                if nid in lost:
                    sel.lost_ops[nid] = lost[nid]
                if name in coll.C10D_KINDS and name not in coll.FUNCTIONAL_WAITS:
                    c10d_calls.add(nid)
            else:
                top = top_of.get(parent)
                nested.add(nid, *_side_values(raw, flat), top)
                if top is not None:
                    top_of[nid] = top
            ctx[nid] = (_IN_FUNCTIONAL if name in coll.FUNCTIONAL_CALLS else max(enclosing, _IN_OP),
                        step, module)
            continue
        if name == SUBCLASS and _enter_frame(sel, raw, flat, parent, selected, unwrapped,
                                             top_of):
            ctx[nid] = (_FREE, step, module)  # the frame's local ops are top-level
            continue
        step, module = _annotation(path, sel, raw, flat, nid, name, step, module)
        if parent in top_of:  # an annotation inside an op (a record_function range)
            top_of[nid] = top_of[parent]
        ctx[nid] = (enclosing, step, module)
    sel.top_level = [t for t in top_level if t[0] is not None]
    return sel


def _freed_mark(raw: dict, flat: bool, nid: int, parent: int, before: tuple[int, int]) -> tuple:
    """A FREED_OP node's ``(id, freed storages, the node it was written at or None)``: the
    fake mode writes it as that node began, as its child or its sibling with the next id
    (actors/trace/recorded_frees.py)."""
    opener = before[0] if parent == before[0] or (parent == before[1]
                                                  and nid == before[0] + 1) else None
    return nid, freed_storages(NodeView(raw, flat).side("inputs")[0]), opener


def _enter_frame(sel: _Selection, raw: dict, flat: bool, parent: int, selected: dict,
                 unwrapped: set, top_of: dict) -> bool:
    """Whether a ``PythonSubclass`` frame belongs to a wrapper op selected outside any op (its
    parent, or the op its parent runs inside): a composite op runs several, under its nested
    ops (``linear``: ``t``, ``mm``) or, on fake, under it (actors/capture/fake/subclass_frames.py
    hangs them there). The wrapper op is then dropped for the frames' local ops, and the frame's
    tensor inputs noted (actors/trace/subclass_wrappers.py)."""
    owner = parent if parent in selected or parent in unwrapped else top_of.get(parent)
    if owner not in selected and owner not in unwrapped:
        return False
    if owner in selected:
        selected.pop(owner)[0] = None
        unwrapped.add(owner)
    sel.under_frame.add(raw["id"])
    add_tensor_storages(_side_values(raw, flat)[0], sel.frame_inputs)
    return True


def _above_backends(parent: int, backend_parent: dict[int, int]) -> int:
    """The first node above ``parent`` that is no backend node (gloo:/nccl: ranges)."""
    for _ in range(_MAX_BACKEND_HOPS):
        if parent not in backend_parent:
            break
        parent = backend_parent[parent]
    return parent


def _fields(path, raw, flat: bool, schema_of) -> tuple[int, str, int, bool]:
    """A raw node's (id, name, parent id, whether it is an op); a TraceError names what is
    malformed."""
    try:
        nid = raw["id"]
        name = raw["name"]
        parent = raw["parent"] if flat else raw["ctrl_deps"]
        if type(nid) is not int or type(name) is not str or type(parent) is not int:
            raise TraceError(path, f"node id {preview(nid, 20)} / name {preview(name, 40)} / "
                                   f"parent {preview(parent, 20)}: expected an integer, a "
                                   "string and an integer node id", raw.get("id"))
        return nid, name, parent, name == "record_param_comms" or bool(schema_of(raw))
    except KeyError as e:
        raise TraceError(path, f"node is missing required field {e.args[0]!r}",
                         raw.get("id")) from None
    except (TypeError, AttributeError):
        raise TraceError(path, "malformed node; expected an object with 'attrs' as a list of "
                               "{name, type, value}", raw.get("id")) from None


def _annotation(path, sel: _Selection, raw, flat: bool, nid: int, name: str, step: int,
                module: str) -> tuple[int, str]:
    """A range that is no op: a ProfilerStep window opening (outside one), the process-group
    table, or a module (its backward markers noted); the (step, module) of its subtree."""
    if name.startswith(STEP_PREFIX) and step < 0:
        step = len(sel.step_names)
        sel.step_names.append(name)
        sel.step_spans.append([nid, nid])
    elif name == PG_INIT:
        sel.pgs = _parse_pg_init(path, NodeView(raw, flat))
    elif not name.startswith(_NOT_MODULE):
        module = name
        if name.startswith(_BACKWARD_MARKERS):
            sel.backward_marks.append((nid, name))
    return step, module


def _keep_in_steps(path, sel: _Selection, full, flat: bool) -> tuple[list, int, dict]:
    """``(ops kept, orphans placed, dropped)``: with ProfilerStep windows, only the ops inside
    them (the rest is set-up, not the iteration); ``dropped`` is {op name: [count, output
    bytes]} of those left out. TraceError when no op is left."""
    top_level, step_names = sel.top_level, sel.step_names
    if not step_names:
        return top_level, 0, {}
    num_orphans = _assign_steps(top_level, sel.step_spans, sel.lost_ops)
    kept, dropped = [], {}
    for t in top_level:
        if t[1] >= 0:
            kept.append(t)
        else:
            count = dropped.setdefault(t[0]["name"], [0, 0])
            count[0] += 1
            count[1] += _output_bytes(full(t[0]), flat)
    if dropped and not kept:
        names = ", ".join(sorted(dropped)[:3])
        raise TraceError(path, f"all {sum(c for c, _ in dropped.values())} recorded ops "
                               f"({names}, ...) lie outside the trace's "
                               f"{len(step_names)} ProfilerStep window(s) "
                               f"({', '.join(step_names[:3])}): the recorded iteration "
                               "holds no op (was the step's range left open?)")
    return kept, num_orphans, dropped


def _make_ops(path, top_level: list, sel: _Selection, full,
              flat: bool) -> tuple[list[Op], list[Step]]:
    """Build the kept ops (each raw node is let go right after) and their steps."""
    parser = ArgParser(path)
    ops: list[Op] = []
    bounds: dict[int, list[int]] = {}  # step -> [first op index, end]
    for i, (node, step, module, _) in enumerate(top_level):
        top_level[i] = None
        ops.append(_build_op(path, parser, full(node), flat, i, step, module, sel.rpc_child))
        if step >= 0:
            # steps cover disjoint, increasing id spans, so each one's ops are contiguous
            bounds.setdefault(step, [i, i])[1] = i + 1
    steps = [Step(sel.step_names[k], first, end) for k, (first, end) in sorted(bounds.items())]
    return ops, steps


def _backward_marks(marks: list, ops: list[Op]) -> tuple:
    """``(node id, qualname, kind)`` of the backward markers recorded strictly inside the op
    span (between the first and the last op kept), in id order; kind is ``bwd_begin`` or
    ``bwd_end`` (actors/trace/conventions.py)."""
    if not ops:
        return ()
    first, last = ops[0].node_id, ops[-1].node_id
    out = []
    for nid, name in marks:
        parsed = parse_module_range(name)
        if parsed is not None and first < nid < last:
            out.append((nid, *parsed))
    return tuple(out)


def _output_bytes(raw: dict, flat: bool) -> int:
    """Bytes of the tensors a raw node returns (what a dropped op would have made)."""
    try:
        values = raw["outputs"] if flat else raw["outputs"]["values"]
    except (KeyError, TypeError):
        return 0
    total = 0
    for v in values if isinstance(values, list) else ():
        for t in (v if isinstance(v, list) and v and isinstance(v[0], list) else [v]):
            if isinstance(t, list) and len(t) == 6 and all(type(x) is int for x in t[2:5]):
                total += max(0, t[3]) * max(0, t[4])
    return total


def _side_values(raw: dict, flat: bool) -> tuple[list, list]:
    """The input and output values of a raw node (whatever they are: nested nodes are not
    replayed, so `storages_made_inside` reads what lists it finds and a malformed node only
    goes unseen)."""
    if flat:
        return raw.get("inputs"), raw.get("outputs")
    sides = raw.get("inputs"), raw.get("outputs")
    return tuple(side.get("values") if isinstance(side, dict) else None for side in sides)


def _assign_steps(top_level, spans, lost_ops: dict[int, int]) -> int:
    """Ops of other threads (autograd, comm hooks) sit outside the step's subtree but inside its
    id span: ids are handed out on op entry, across threads, in time order. An orphan (under a
    range never written, ``lost_ops``: op id -> that range's id) belongs to the window its
    range opened in, up to the next step's start. Returns how many orphans were placed."""
    starts = [span[0] for span in spans]
    placed = 0
    for entry in top_level:
        if entry[1] < 0:
            nid = entry[0]["id"]
            k = bisect.bisect_right(starts, nid) - 1
            if k < 0:
                continue
            if nid <= spans[k][1]:
                entry[1] = k
            if nid in lost_ops and starts[k] <= lost_ops[nid]:
                entry[1] = k
                placed += 1
    return placed


def _build_op(path, parser, raw, flat, index, step, module, rpc_child) -> Op:
    view = NodeView(raw, flat)
    nid = raw["id"]
    name = raw["name"]
    try:
        attrs = view.attrs()
        inputs = parser.parse_side(view.side("inputs"), nid)
        outputs = parser.parse_side(view.side("outputs"), nid)
    except KeyError as e:
        raise TraceError(path, f"node is missing required field {e.args[0]!r}", nid) from None
    except (TypeError, AttributeError):
        raise TraceError(path, "malformed node; expected 'attrs' as a list of {name, type, value} "
                               "and 'inputs'/'outputs' as {values, shapes, types}", nid) from None
    schema = attrs.get("op_schema") or ""
    rf_id = attrs.get("rf_id")
    if type(schema) is not str or not (rf_id is None or type(rf_id) is int):
        raise TraceError(path, f"attrs op_schema {preview(schema, 40)} / rf_id {preview(rf_id, 20)}: "
                               "expected a string and an integer", nid)
    collective = None
    try:
        if name == "record_param_comms":
            collective = coll.from_record_param_comms(inputs, {} if flat else attrs, outputs)
        elif name in coll.C10D_KINDS:
            collective = coll.from_c10d(name, _schema_arg_names(schema), inputs, outputs)
            child = rpc_child.get(nid)
            if child is not None:
                cview = NodeView(child, flat)
                cattrs = {} if flat else cview.attrs()
                rpc = coll.from_record_param_comms(parser.parse_side(cview.side("inputs"), child["id"]),
                                                   cattrs,
                                                   parser.parse_side(cview.side("outputs"), child["id"]))
                collective = coll.merge(collective, rpc, rpc_has_counts="in_msg_nelems" in cattrs)
        if collective is not None:
            coll.check(collective)
    except ValueError as e:
        raise TraceError(path, str(e), nid) from None
    except (TypeError, KeyError, IndexError, AttributeError) as e:
        raise TraceError(path, f"malformed {name} record ({type(e).__name__}: {e}); expected the "
                               "arguments and attrs PyTorch's observer writes", nid) from None
    ranges = attrs.get("tensor_range")
    tensor_ranges = _parse_ranges(ranges) if ranges else None
    return Op(index, nid, name, schema, inputs, outputs, tensor_ranges, module, step,
              collective, attrs.get("tid", 0), rf_id)


def _parse_ranges(value) -> dict | None:
    """``tensor_range`` is a JSON object string {input position: [min, max]}."""
    try:
        doc = orjson.loads(value) if isinstance(value, str) else value
        return {int(k): (v[0], v[1]) for k, v in doc.items()
                if isinstance(v, list) and len(v) == 2 and all(map(_is_number, v))}
    except (orjson.JSONDecodeError, ValueError, TypeError, AttributeError):
        return None


def _is_number(x) -> bool:
    return type(x) in (int, float)


def _parse_pg_init(path, view: NodeView) -> list[ProcessGroupInfo]:
    try:
        values = view.side("inputs")[0]
        entries = orjson.loads(values[0]) if values and isinstance(values[0], str) else values[0]
        groups = [ProcessGroupInfo(name=str(e["pg_name"]), desc=str(e.get("pg_desc", "")),
                                   backend=str(e.get("backend_config", "")),
                                   ranks=tuple(int(r) for r in e.get("ranks") or ()),
                                   group_size=int(e.get("group_size", 0)))
                  for e in entries]
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, IndexError,
            AttributeError) as e:
        raise TraceError(path, f"malformed process-group table ({e!r}); expected a JSON list of "
                               "{pg_name, pg_desc, backend_config, ranks, group_size}",
                         view.raw.get("id")) from None
    for g in groups:  # checks and group tables build per-rank lists: bound them first
        if not (0 <= g.group_size <= MAX_WORLD_SIZE and len(g.ranks) <= MAX_WORLD_SIZE
                and all(0 <= r < MAX_WORLD_SIZE for r in g.ranks)):
            raise TraceError(path, f"process group {g.name!r} has group_size {g.group_size} and "
                                   f"ranks {str(list(g.ranks))[:60]}; expected sizes and ranks "
                                   f"from 0 to {MAX_WORLD_SIZE:,}", view.raw.get("id"))
    return groups
