"""DTensor's dispatch frames in a fake trace, told from the fake mode's own.

Under the fake mode every op runs inside a ``PythonDispatchMode`` frame. When the op's
arguments are DTensors, DTensor runs its local ops under that frame (a real device records
it as ``PythonSubclass``, and the loader replaces the wrapper op by those local ops);
otherwise the frame holds the fake mode's kernels and decompositions, which
:func:`actors.capture.fake.fake_mode.strip_dispatch_mode_nodes` removes. The strip recognizes a
DTensor frame by the op running again, by name, under it (FSDP2's sharded parameters); on a
tensor-parallel mesh DTensor's handlers run other ops (``loss_parallel``'s cross-entropy
runs ``amax``, ``sub``, ``exp``, all-reduces, ...; ``type_as`` runs ``_to_copy``).

The rule here: a frame is DTensor's when the op above it reads a storage that nothing under
the frame reads. DTensor wrappers own no storage (the observer gives them all one shared
storage id) and the local ops read the local tensors instead; a decomposition reads the
op's own inputs. (A decomposition that ignores an input, ``new_zeros`` -> ``empty`` +
``zero_``, is taken for a subclass frame too: its ops then replace the op, for the same
memory.)

The loader replaces a top-level op by the ops of the ``PythonSubclass`` frames right below
it. DTensor often dispatches deeper, inside a composite op (``type_as`` -> ``to`` ->
``_to_copy`` -> frame): such a frame is hung directly under its top-level op, whose local
work it is.
"""
from __future__ import annotations

from actors.capture.fake.fake_mode import DISPATCH_MODE_NODE, SUBCLASS_NODE

_FRAMES = (DISPATCH_MODE_NODE, SUBCLASS_NODE)


def _storages(side: dict) -> list[tuple[int, str]]:
    out = []
    for value, type_ in zip(side["values"], side["types"]):
        if type_.startswith("Tensor(") and isinstance(value, list) and len(value) == 6:
            out.append((value[1], value[5]))
        elif type_.startswith("GenericList") and isinstance(value, list):
            out += [(v[1], v[5]) for v in value if isinstance(v, list) and len(v) == 6]
    return out


def mark_subclass_frames(doc: dict) -> int:
    """Rename the DTensor frames of the raw fake trace ``doc`` (edited in place) to
    ``PythonSubclass``, before the strip; returns how many.

    Frames are judged innermost first: a DTensor handler may call DTensor ops itself
    (``loss_parallel``'s backward casts its DTensor gradient with ``.to``), and such an inner
    wrapper op reads the wrapper storage; it counts by the local ops below it instead.
    """
    nodes = {n["id"]: n for n in doc["nodes"]}
    children: dict[int, list[int]] = {}
    for n in doc["nodes"]:
        if n["ctrl_deps"] != n["id"] and n["ctrl_deps"] in nodes:
            children.setdefault(n["ctrl_deps"], []).append(n["id"])
    depth: dict[int, int] = {}

    def depth_of(nid: int) -> int:
        chain = []
        while nid not in depth and nid in nodes and nodes[nid]["ctrl_deps"] in nodes \
                and nodes[nid]["ctrl_deps"] != nid and len(chain) <= len(nodes):
            chain.append(nid)
            nid = nodes[nid]["ctrl_deps"]
        d = depth.get(nid, 0)
        for seen in reversed(chain):
            d += 1
            depth[seen] = d
        return depth.get(chain[0], d) if chain else d

    wrappers: set[int] = set()  # ops whose frame was found to be DTensor's
    read: dict[int, frozenset] = {}  # node -> storages read or written by the work below it

    frames = [n for n in doc["nodes"] if n["name"] == DISPATCH_MODE_NODE
              and n["ctrl_deps"] in nodes and n["ctrl_deps"] != n["id"]]
    frames.sort(key=lambda n: -depth_of(n["id"]))
    marked = []
    for frame in frames:
        op = nodes[frame["ctrl_deps"]]
        reads = [s for s, dev in _storages(op["inputs"]) if dev != "meta" and s]
        if not reads:
            continue
        below = _work_below(frame["id"], nodes, children, wrappers, read)
        if below and any(s not in below for s in reads):
            frame["name"] = SUBCLASS_NODE
            wrappers.add(op["id"])
            marked.append(frame)
    for frame in marked:  # outermost first is not needed: a frame hangs under the top op
        top = _top_op(nodes, frame["ctrl_deps"])
        if top is not None and not _inside_frame(nodes, frame, top):
            frame["ctrl_deps"] = top
    return len(marked)


def _work_below(nid: int, nodes: dict, children: dict, wrappers: set, read: dict) -> frozenset:
    """The storages read or written by the work below node ``nid`` (memoized in ``read``).
    A module function, not a closure over the trace: a recursive closure is a reference
    cycle, which kept a whole parsed trace (7 GB on a 405B pipeline stage) alive until the
    cyclic GC ran, and the capture pauses it."""
    if nid not in read:
        out = set()
        for child in children.get(nid, ()):
            node = nodes[child]
            tensors = _storages(node["inputs"]) + _storages(node["outputs"])
            if any(dev == "meta" for _, dev in tensors):
                continue  # the fake mode's kernels: not the op's work
            # a frame repeats its op's tensors; a wrapper op's are the wrappers
            if child not in wrappers and node["name"] not in _FRAMES:
                out.update(s for s, _ in tensors)
            out |= _work_below(child, nodes, children, wrappers, read)
        read[nid] = frozenset(out)
    return read[nid]


def _is_op(node: dict) -> bool:
    return any(a["name"] == "op_schema" and a["value"] for a in node.get("attrs", ()))


def _top_op(nodes: dict, nid: int) -> int | None:
    """The outermost op among ``nid`` and its ancestors (the op the loader keeps)."""
    top, seen = None, 0
    while nid in nodes and seen <= len(nodes):
        if _is_op(nodes[nid]):
            top = nid
        parent = nodes[nid]["ctrl_deps"]
        if parent == nid:
            break
        nid, seen = parent, seen + 1
    return top


def _inside_frame(nodes: dict, frame: dict, top: int) -> bool:
    """Whether a subclass frame lies between ``frame`` and ``top`` (nested DTensor calls: the
    inner frame's work belongs to the outer one's local ops, which the loader keeps)."""
    nid = frame["ctrl_deps"]
    while nid != top and nid in nodes:
        if nodes[nid]["name"] == SUBCLASS_NODE:
            return True
        nid = nodes[nid]["ctrl_deps"]
    return False
