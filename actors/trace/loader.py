"""Load one rank's Execution Trace (``.json`` / ``.json.gz``) into the compact `Trace` model.

Only top-level operators are kept: an op (a node with an op schema, or a
``record_param_comms`` node) whose ancestors contain no other op. Annotation nodes
(``record_function`` ranges, autograd engine frames, ``ProfilerStep#N``) are transparent;
they only contribute the enclosing module name and step window.
"""
from __future__ import annotations

import bisect
import gc
import gzip
import re
import tarfile
import zlib
from functools import lru_cache
from pathlib import Path

import orjson

from actors.errors import ReplayError, TraceError
from actors.trace import collectives as coll
from actors.trace.args import ArgParser
from actors.trace.model import Op, ProcessGroupInfo, Step, Trace
from actors.trace.op_schema import parse_schema
from actors.trace.schema import NodeView, OpSchemaReader, parse_version
from actors.trace.tensor_ids import TensorIdAssigner

PG_INIT = "## process_group:init ##"
STEP_PREFIX = "ProfilerStep#"
_RANK_IN_NAME = re.compile(r"rank-?(\d+)")
# Annotation frames that are not module boundaries.
_NOT_MODULE = ("[pytorch|profiler", "autograd::engine", STEP_PREFIX, "## process_group")
_WAIT_TENSOR = "_c10d_functional::wait_tensor"


def read_json(path, data: bytes | None = None) -> dict:
    """Read a trace file's JSON (plain, gzip, or a tar archive with one JSON member).

    ``data`` are the file's bytes when they arrived another way (Ray's object store).
    """
    path = Path(path)
    if data is None:
        try:
            data = path.read_bytes()
        except OSError as e:
            raise TraceError(path, f"cannot read file: {e.strerror or e}") from None
    try:
        if data[:2] == b"\x1f\x8b":
            data = gzip.decompress(data)
        if len(data) > 262 and data[257:262] == b"ustar":
            data = _single_tar_member(path, data)
    except (OSError, EOFError, zlib.error, tarfile.TarError) as e:
        raise TraceError(path, f"truncated or corrupt compressed file ({e})") from None
    try:
        doc = orjson.loads(data)
    except orjson.JSONDecodeError as e:
        if data and e.pos >= len(data):
            raise TraceError(path, f"truncated JSON: the data ends at byte {len(data)} inside the "
                                   "document (was the file cut while being written or copied?)") from None
        raise TraceError(path, f"invalid JSON ({e}); expected an Execution Trace JSON object") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("nodes"), list):
        raise TraceError(path, "expected a JSON object with a 'nodes' list")
    return doc


def _single_tar_member(path, data: bytes) -> bytes:
    import io
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        members = [m for m in tar.getmembers() if m.isfile() and m.name.endswith(".json")]
        if len(members) != 1:
            raise TraceError(path, f"tar archive holds {len(members)} JSON files; expected exactly one "
                                   "(extract multi-rank archives into rank-<r>.json files)")
        return tar.extractfile(members[0]).read()


def rank_from_name(path) -> int | None:
    """The rank encoded in a file name like ``rank-3.et.json.gz`` (None if absent)."""
    m = _RANK_IN_NAME.search(Path(path).name)
    return int(m.group(1)) if m else None


@lru_cache(maxsize=4096)
def _schema_arg_names(schema: str) -> tuple[str, ...]:
    """Argument names of an op schema, in order (() when it does not parse)."""
    try:
        return tuple(a.name for a in parse_schema(schema).args)
    except ReplayError:
        return ()


def load_trace(path, rank: int | None = None, data: bytes | None = None) -> Trace:
    """Load and validate one rank's trace file (or its bytes, named by ``path``) into a `Trace`."""
    # Parsing and building create millions of small containers, none in a reference cycle;
    # left on, the cyclic GC rescans the growing heap over and over (2-3x the load time).
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _load_trace(Path(path), rank, data)
    finally:
        if gc_was_enabled:
            gc.enable()


def _load_trace(path: Path, rank: int | None, data: bytes | None) -> Trace:
    doc = read_json(path, data)
    version = parse_version(path, doc.get("schema"))
    flat = version < (1, 0, 2)
    nodes = doc.pop("nodes")  # _build_ops frees the raw nodes as it goes (peak memory)
    num_nodes = len(nodes)
    try:
        nodes.sort(key=lambda n: n["id"])
    except (KeyError, TypeError):
        bad = next((n for n in nodes if not isinstance(n, dict) or not isinstance(n.get("id"), int)), None)
        raise TraceError(path, f"a node has no integer 'id' (node starts {str(bad)[:80]!r})") from None
    ops, pgs, steps, num_outside = _build_ops(path, nodes, flat)
    assigner = TensorIdAssigner()
    for op in ops:
        assigner.assign(op)
    coll.link_waits(ops)
    return Trace(path=str(path), schema=doc["schema"], num_nodes=num_nodes, ops=ops,
                 process_groups=pgs, steps=steps, num_tensors=assigner.num_tensors,
                 num_storages=assigner.num_storages,
                 rank=rank if rank is not None else rank_from_name(path),
                 meta={"pid": doc.get("pid"), "time": doc.get("time"),
                       "num_ops_outside_steps": num_outside})


def _build_ops(path, nodes: list, flat: bool):
    """Select top-level ops in id order and build them; returns (ops, pgs, steps, num_outside).

    Empties ``nodes``: once the ops are selected the other raw nodes are dropped, and each
    selected one right after its op is built, so the raw JSON and the model never peak together.
    """
    # Per node id: (inside an op?, step index, module name). Parents precede children in id order.
    ctx: dict[int, tuple[bool, int, str]] = {}
    top_level: list = []  # [raw node, step, module] per selected op
    rpc_child: dict[int, dict] = {}
    top_names: dict[int, str] = {}  # node id -> name of each selected op
    step_names: list[str] = []
    step_spans: list[list[int]] = []  # [first id, last id] of each ProfilerStep subtree
    pgs: list[ProcessGroupInfo] = []
    schema_of = OpSchemaReader(flat)
    for raw in nodes:
        try:
            nid = raw["id"]
            name = raw["name"]
            parent = raw["parent"] if flat else raw["ctrl_deps"]
            is_op = name == "record_param_comms" or bool(schema_of(raw))
        except KeyError as e:
            raise TraceError(path, f"node is missing required field {e.args[0]!r}",
                             raw.get("id")) from None
        except (TypeError, AttributeError):
            raise TraceError(path, "malformed node; expected an object with 'attrs' as a list of "
                                   "{name, type, value}", raw.get("id")) from None
        inside, step, module = ctx.get(parent, (False, -1, ""))
        if step >= 0:
            step_spans[step][1] = nid
        if is_op:
            if not inside or (name == _WAIT_TENSOR and top_names.get(parent) in coll.C10D_KINDS):
                # The observer's parent links are unreliable around collectives: a functional
                # wait_tensor (always a call of its own) can show up under the collective it waits for.
                top_level.append([raw, step, module])
                top_names[nid] = name
            elif name == "record_param_comms" and parent in top_names:
                rpc_child[parent] = raw
            ctx[nid] = (True, step, module)
            continue
        if name.startswith(STEP_PREFIX) and step < 0:
            step = len(step_names)
            step_names.append(name)
            step_spans.append([nid, nid])
        elif name == PG_INIT:
            pgs = _parse_pg_init(path, NodeView(raw, flat))
        elif not name.startswith(_NOT_MODULE):
            module = name
        ctx[nid] = (inside, step, module)
    nodes.clear()
    del ctx
    num_outside = 0
    if step_names:  # honour ProfilerStep windows: ops outside them are set-up, not iterations
        _assign_steps(top_level, step_spans)
        kept = [t for t in top_level if t[1] >= 0]
        num_outside = len(top_level) - len(kept)
        top_level = kept
    parser = ArgParser(path)
    ops: list[Op] = []
    bounds: dict[int, list[int]] = {}  # step -> [first op index, end]
    for i, (raw, step, module) in enumerate(top_level):
        top_level[i] = None
        ops.append(_build_op(path, parser, raw, flat, i, step, module, rpc_child))
        if step >= 0:
            # steps cover disjoint, increasing id spans, so each one's ops are contiguous
            bounds.setdefault(step, [i, i])[1] = i + 1
    steps = [Step(step_names[k], first, end) for k, (first, end) in sorted(bounds.items())]
    return ops, pgs, steps, num_outside


def _assign_steps(top_level, spans) -> None:
    """Ops of other threads (autograd, comm hooks) sit outside the step's subtree but inside its
    id span: ids are handed out on op entry, across threads, in time order."""
    starts = [span[0] for span in spans]
    for entry in top_level:
        if entry[1] < 0:
            nid = entry[0]["id"]
            k = bisect.bisect_right(starts, nid) - 1
            if k >= 0 and nid <= spans[k][1]:
                entry[1] = k


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
    schema = attrs.get("op_schema") or ""
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
    except ValueError as e:
        raise TraceError(path, str(e), nid) from None
    ranges = attrs.get("tensor_range")
    tensor_ranges = _parse_ranges(ranges) if ranges else None
    return Op(index, nid, name, schema, inputs, outputs, tensor_ranges, module, step,
              collective, attrs.get("tid", 0), attrs.get("rf_id"))


def _parse_ranges(value) -> dict | None:
    """``tensor_range`` is a JSON object string {input position: [min, max]}."""
    try:
        doc = orjson.loads(value) if isinstance(value, str) else value
        return {int(k): (v[0], v[1]) for k, v in doc.items()
                if isinstance(v, list) and len(v) == 2}
    except (orjson.JSONDecodeError, ValueError, TypeError, AttributeError):
        return None


def _parse_pg_init(path, view: NodeView) -> list[ProcessGroupInfo]:
    values = view.side("inputs")[0]
    try:
        entries = orjson.loads(values[0]) if values and isinstance(values[0], str) else values[0]
        return [ProcessGroupInfo(name=str(e["pg_name"]), desc=str(e.get("pg_desc", "")),
                                 backend=str(e.get("backend_config", "")),
                                 ranks=tuple(int(r) for r in e.get("ranks") or ()),
                                 group_size=int(e.get("group_size", 0)))
                for e in entries]
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, IndexError) as e:
        raise TraceError(path, f"malformed process-group table ({e!r}); expected a JSON list of "
                               "{pg_name, pg_desc, backend_config, ranks, group_size}",
                         view.raw.get("id")) from None
