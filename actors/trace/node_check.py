"""Every node of a trace checked as the loader checks the ops it replays, for the nodes it
does not: the replay reads only top-level ops' arguments (strictly: actors/trace/loader.py,
integrity.py), so an impossible shape or a retyped input in a nested node (an op inside an op,
a range's record) changes nothing it does and passes without a word. ``tracefleet-inspect``
reports them (``--strict``: as an error), each naming the node, since a trace from elsewhere
with such nodes may be damaged in places the replay cannot see.
"""
from __future__ import annotations

from actors.errors import TraceError
from actors.trace import integrity
from actors.trace.args import ArgParser, preview
from actors.trace.node_stream import read_json
from actors.trace.model import Op
from actors.trace.schema import NodeView, parse_version
from actors.trace.source import as_source

MAX_NAMED = 20  # implausible nodes named in a report (all are counted)
_NAME_CHARS = 60  # a node's name as shown (a 20 MiB name stays one short line)


def implausible_nodes(path, max_named: int = MAX_NAMED) -> dict:
    """``{"num_nodes": N, "examples": [message, ...]}`` of the nodes of the trace at ``path``
    whose arguments the loader would refuse in a top-level op (the first ``max_named``)."""
    source = as_source(path)
    doc = read_json(source)
    where = str(source)
    flat = parse_version(where, doc.get("schema")) < (1, 0, 2)
    parser = ArgParser(where)
    found, examples = 0, []
    for raw in doc.get("nodes") or ():
        problem = _problem(where, parser, raw, flat)
        if problem is not None:
            found += 1
            if len(examples) < max_named:
                examples.append(problem)
    return {"num_nodes": found, "examples": examples}


def _problem(where: str, parser: ArgParser, raw, flat: bool) -> str | None:
    """What is wrong with one node's arguments, None when nothing is."""
    if not isinstance(raw, dict):
        return f"a node that is not an object ({preview(raw, 40)})"
    nid, name = raw.get("id"), raw.get("name")
    shown = name if isinstance(name, str) and len(name) <= _NAME_CHARS else preview(name, 60)
    label = f"node {nid} ({shown})"
    view = NodeView(raw, flat)
    try:
        inputs = parser.parse_side(view.side("inputs"), nid)
        outputs = parser.parse_side(view.side("outputs"), nid)
        schema = view.attrs().get("op_schema") or ""
        if type(schema) is not str:
            return f"{label}: op_schema {preview(schema, 40)} is not a string"
        integrity.check_ops(where, [Op(0, nid, name, schema, inputs, outputs, None, "", -1,
                                       None, 0)])
    except TraceError as e:
        return f"{label}: {e.detail}"
    except KeyError as e:
        return f"{label}: missing field {e.args[0]!r}"
    except (TypeError, AttributeError, ValueError, IndexError):
        return f"{label}: arguments not in the observer's layout ({{values, shapes, types}})"
    return None
