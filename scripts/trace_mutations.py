"""Seeded mutations of real Execution Traces for scripts/fuzz_traces.py.

The corpus: the bundled demo traces and the public PARAM traces, each cut into a few windows
of consecutive nodes (in id order, plus the process and thread roots and the process-group
table), so one case parses and replays in tens of milliseconds; small traces are also kept
whole. A case is a window with one to three node-level mutations, written in one of several
file forms (plain, gzip, truncated gzip, flipped bytes, random bytes). Everything follows
from (seed, case index): a case is re-created from its index alone.
"""
from __future__ import annotations

import copy
import gzip
import random
from pathlib import Path

import orjson

REPO = Path(__file__).resolve().parents[1]


def _public_dir() -> Path:
    """The public PARAM traces: beside the checkout, else the workplace's shared folder."""
    shared = next((p for p in (REPO.parent / "shared", Path("/work/shared")) if p.is_dir()),
                  REPO.parent / "shared")
    return shared / "traces" / "public" / "param"


DEFAULT_SOURCES = [*sorted((REPO / "demo" / "traces").glob("*/rank-*.et.json.gz")),
                   *sorted(_public_dir().glob("*"))]
WINDOW_NODES = 240
WINDOWS_PER_TRACE = 6
WHOLE_MAX_NODES = 1000
_ROOT_MARKS = ("[pytorch|profiler|execution_trace|", "## process_group:init ##")
_DEEP = "__deeply_nested_list__"
HUGE = [10**12, 2**62, 2**63 - 1, -1, -(2**40), 0, 3 * 10**9]
WEIRD = [None, True, "", "12", "x" * 40, 1.5, 1e300, -7, [], {}, [1, [2, [3]]], {"a": 1},
         "inf", "nan", "<None>", 2**63 - 1]


def build_corpus(sources, seed: int) -> list[tuple[str, int, bytes]]:
    """``(label, rank, JSON bytes)`` windows of every rank trace of ``sources``."""
    from actors.trace.node_stream import read_json
    from actors.trace.source import discover

    rng = random.Random(f"corpus:{seed}")
    corpus = []
    for path in sources:
        for rank, source in list(discover(path).items())[:2]:  # two ranks of a multi-rank job
            doc = read_json(source)
            nodes = sorted((n for n in doc["nodes"] if isinstance(n, dict)),
                           key=lambda n: n.get("id", 0))
            label = f"{Path(path).name}:{rank}"
            roots = [n for n in nodes if str(n.get("name", "")).startswith(_ROOT_MARKS)]
            if len(nodes) <= WHOLE_MAX_NODES:
                corpus.append((label, rank, orjson.dumps(doc)))
            for _ in range(WINDOWS_PER_TRACE):
                start = rng.randrange(max(1, len(nodes) - WINDOW_NODES))
                window = nodes[start:start + WINDOW_NODES]
                kept = [n for n in roots if n not in window] + window
                corpus.append((f"{label}@{start}", rank,
                               orjson.dumps({**doc, "nodes": kept})))
    return corpus


def make_case(corpus, seed: int, index: int) -> tuple[str, int, str, bytes, list[str]]:
    """``(base label, rank, file suffix, file bytes, mutation descriptions)`` of case ``index``."""
    rng = random.Random(f"{seed}:{index}")
    label, rank, data = corpus[rng.randrange(len(corpus))]
    doc = orjson.loads(data)
    done = [_mutate(doc, rng) for _ in range(rng.choice((1, 1, 2, 3)))]
    text = orjson.dumps(doc)
    for depth in (200, 900, 1000):  # orjson writes 254 levels at most: spliced in as text
        mark = f'"{_DEEP}{depth}"'.encode()
        text = text.replace(mark, b"[" * depth + b'[0,0,0,0,4,"cpu"]' + b"]" * depth)
    form = rng.choices(["json", "gzip", "truncated_gzip", "flipped", "random_bytes", "empty"],
                       [40, 40, 6, 8, 4, 2])[0]
    if form == "gzip":
        return label, rank, ".json.gz", gzip.compress(text, 1), done
    if form == "truncated_gzip":
        packed = gzip.compress(text, 1)
        return label, rank, ".json.gz", packed[:rng.randrange(1, len(packed))], done + [form]
    if form == "flipped":
        raw = bytearray(text)
        for _ in range(rng.randint(1, 8)):
            raw[rng.randrange(len(raw))] = rng.randrange(256)
        return label, rank, ".json", bytes(raw), done + [form]
    if form == "random_bytes":
        return label, rank, rng.choice([".json", ".json.gz"]), rng.randbytes(rng.randint(1, 4096)), \
            done + [form]
    if form == "empty":
        return label, rank, ".json", b"", done + [form]
    return label, rank, ".json", text, done


# --- node-level mutations --------------------------------------------------------------------

def _mutate(doc: dict, rng: random.Random) -> str:
    nodes = doc.get("nodes")
    if not isinstance(nodes, list) or not any(isinstance(n, dict) for n in nodes):
        return _top_level(doc, rng)
    name, fn = rng.choice(_MUTATIONS)
    return f"{name}: {fn(doc, nodes, rng)}"


def _node(nodes, rng, want=None) -> dict:
    """A random node; ``want`` filters (falls back to any node)."""
    pool = [n for n in nodes if isinstance(n, dict) and (want is None or want(n))]
    return rng.choice(pool or [n for n in nodes if isinstance(n, dict)])


def _is_op(n) -> bool:
    return isinstance(n, dict) and bool(n.get("inputs"))


def _containers(value, path="", out=None) -> list[tuple[str, object]]:
    """Every (path, dict or list) inside ``value``."""
    out = [] if out is None else out
    if isinstance(value, (dict, list)):
        out.append((path, value))
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for k, v in items:
            if len(out) < 400:
                _containers(v, f"{path}/{k}", out)
    return out


def _tensor_tuples(node) -> list[list]:
    return [c for _, c in _containers(node) if isinstance(c, list) and len(c) == 6
            and isinstance(c[0], int) and isinstance(c[5], str)]


def _drop_key(doc, nodes, rng):
    n = _node(nodes, rng, _is_op)
    path, box = rng.choice(_containers(n))
    if isinstance(box, dict) and box:
        key = rng.choice(list(box))
        del box[key]
        return f"node {n.get('id')} del {path}/{key}"
    if isinstance(box, list) and box:
        i = rng.randrange(len(box))
        del box[i]
        return f"node {n.get('id')} del {path}/{i}"
    return "nothing to drop"


def _retype(doc, nodes, rng):
    n = _node(nodes, rng, _is_op)
    path, box = rng.choice(_containers(n))
    if not box:
        return "empty container"
    key = rng.choice(list(box)) if isinstance(box, dict) else rng.randrange(len(box))
    value = copy.deepcopy(rng.choice(WEIRD + HUGE))
    box[key] = value
    return f"node {n.get('id')} {path}/{key} = {str(value)[:30]}"


def _some_tensor_tuple(nodes, rng):
    """A tensor tuple from one of up to 40 sampled nodes; None when they hold none."""
    tuples = [t for n in rng.sample(nodes, min(len(nodes), 40)) if isinstance(n, dict)
              for t in _tensor_tuples(n)]
    return rng.choice(tuples) if tuples else None


def _huge_tensor(doc, nodes, rng):
    t = _some_tensor_tuple(nodes, rng)
    if t is None:
        return "no tensor"
    field = rng.randrange(6)
    t[field] = rng.choice(HUGE + ["cpu", "cuda:99", "", 0.5])
    return f"tensor field {field} = {str(t[field])[:24]}"


def _bad_shape(doc, nodes, rng):
    n = _node(nodes, rng, _is_op)
    shapes = [c for p, c in _containers(n) if "shape" in p and isinstance(c, list)]
    if not shapes:
        return "no shapes"
    box = rng.choice(shapes)
    choice = rng.randrange(4)
    if choice == 0 and box:
        box[rng.randrange(len(box))] = rng.choice(HUGE + [[10**12], [-3, 4], "7"])
    elif choice == 1:
        box.append([10**12, 10**12])
    elif choice == 2:
        box.extend([[1]] * rng.randint(1, 5000))  # a long list
    else:
        box.clear()
    return f"node {n.get('id')} shapes #{choice}"


def _parent_link(doc, nodes, rng):
    n, m = _node(nodes, rng), _node(nodes, rng)
    key = "ctrl_deps" if "ctrl_deps" in n else "parent"
    kind = rng.randrange(4)
    if kind == 0:  # self cycle
        n[key] = n.get("id")
    elif kind == 1:  # two-node cycle
        n[key], m[key] = m.get("id"), n.get("id")
    elif kind == 2:  # dangling
        n[key] = rng.choice([10**9, -5, 2**62])
    else:  # a child of one of its descendants' ids
        n[key] = max((x["id"] for x in nodes if isinstance(x, dict) and isinstance(x.get("id"), int)),
                     default=0)
    return f"node {n.get('id')} {key} #{kind} -> {n[key]}"


def _duplicate(doc, nodes, rng):
    n = _node(nodes, rng)
    if rng.random() < 0.5:
        nodes.insert(rng.randrange(len(nodes) + 1), copy.deepcopy(n))
        return f"node {n.get('id')} copied"
    other = _node(nodes, rng)
    n["id"] = other.get("id")
    return f"id {other.get('id')} given to a second node"


def _tensor_tuple_shape(doc, nodes, rng):
    t = _some_tensor_tuple(nodes, rng)
    if t is None:
        return "no tensor"
    kind = rng.randrange(3)
    if kind == 0:
        t.pop()
    elif kind == 1:
        t.append(rng.choice(HUGE))
    else:
        t[rng.randrange(6)] = str(t[0])
    return f"tensor tuple #{kind}"


def _numbers_as_strings(doc, nodes, rng):
    n = _node(nodes, rng)
    keys = [k for k in ("id", "ctrl_deps", "parent") if k in n and rng.random() < 0.6]
    n.update({k: str(n[k]) for k in keys})
    return f"node {n.get('id')} ids as strings"


def _comm_attrs(doc, nodes, rng):
    n = _node(nodes, rng, lambda x: x.get("name") in ("record_param_comms", "## process_group:init ##")
              or str(x.get("name", "")).startswith("c10d::"))
    attrs = n.get("attrs")
    if isinstance(attrs, list) and attrs and rng.random() < 0.6:
        a = rng.choice(attrs)
        if isinstance(a, dict):
            a["value"] = copy.deepcopy(rng.choice(WEIRD + HUGE + [[10**12] * 3, "[1,2", "{}"]))
            return f"node {n.get('id')} attr {a.get('name')}"
    values = (n.get("inputs") or {}).get("values") if isinstance(n.get("inputs"), dict) \
        else n.get("inputs")
    if isinstance(values, list) and values:
        i = rng.randrange(len(values))
        values[i] = copy.deepcopy(rng.choice(WEIRD + HUGE + ['[{"pg_name": 0}]', "[", '[{"ranks": "x"}]']))
        return f"node {n.get('id')} input {i}"
    return "no comm node"


def _deep_nest(doc, nodes, rng):
    n = _node(nodes, rng, _is_op)
    depth = rng.choice((200, 900, 1000))
    value = f"{_DEEP}{depth}"  # make_case writes the nested list itself
    side = n.get("inputs")
    if isinstance(side, dict) and isinstance(side.get("values"), list) and side["values"]:
        side["values"][0] = value
        if isinstance(side.get("types"), list) and side["types"]:
            side["types"][0] = "GenericList[Tensor(float)]"
    else:
        n["inputs"] = [value]
    return f"node {n.get('id')} nested {depth}"


def _rename(doc, nodes, rng):
    n = _node(nodes, rng, _is_op)
    n["name"] = rng.choice(["aten::", "aten::mm", "c10d::allreduce_", "record_param_comms",
                            "ProfilerStep#1", "gloo:all_reduce", "## process_group:init ##",
                            "c10d::alltoall_base_", "_c10d_functional::wait_tensor", 7])
    return f"node {n.get('id')} renamed {n['name']}"


def _op_schema(doc, nodes, rng):
    n = _node(nodes, rng, _is_op)
    for a in n.get("attrs") or ():
        if isinstance(a, dict) and a.get("name") == "op_schema" and isinstance(a.get("value"), str):
            s = a["value"]
            a["value"] = rng.choice([s[:rng.randrange(len(s) + 1)], s.replace("Tensor", "int"),
                                     s + ")", "(", "aten::x(Tensor self) -> (Tensor, int[10])"])
            return f"node {n.get('id')} op_schema"
    if "op_schema" in n:
        n["op_schema"] = "aten::mm("
    return f"node {n.get('id')} op_schema (flat)"


def _top_level(doc, rng):
    key = rng.choice(["schema", "nodes", "pid"])
    doc[key] = copy.deepcopy(rng.choice(WEIRD + ["2.0.0", "1.0.0", "1.1.9-x", [{"id": 1}], [1, 2]]))
    return f"top-level {key} = {str(doc[key])[:30]}"


_MUTATIONS = [("drop_key", _drop_key), ("retype", _retype), ("huge_tensor", _huge_tensor),
              ("bad_shape", _bad_shape), ("parent_link", _parent_link), ("duplicate_id", _duplicate),
              ("tensor_tuple", _tensor_tuple_shape), ("numbers_as_strings", _numbers_as_strings),
              ("comm", _comm_attrs), ("deep_nest", _deep_nest), ("rename", _rename),
              ("op_schema", _op_schema),
              ("top_level", lambda doc, nodes, rng: _top_level(doc, rng))]
