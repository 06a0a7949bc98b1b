"""Parent links the observer wrote wrong while another thread ran, mended from the file order.

The execution-trace observer gives a node the node open when it opened as its parent, but a
collective backend's thread opens and closes nodes at the same time (gloo runs a collective's
work on a thread of its own, and its ``gloo:<kind>`` range opens there), and then ops of the
calling thread land under the wrong parent. Seen on one CPU DDP step captured six times (world
1, gloo), the rest of the trace identical: the buffer broadcast's second
``flatten_dense_tensors`` under a ``gloo:broadcast`` that opened after it, or only its ``cat``
under that range (lifted to the range's parent, the ``cat`` became a top-level op beside the
``flatten_dense_tensors`` that ran it: its memory replayed twice), a module's backward marker
under a ``gloo:all_reduce``, the reducer's bucket views under a view that had closed. In the
bundled ZeRO-3 demo, the Python ``narrow``/``view``/``.data =`` after an async all-gather sat
under the ``c10d::_allgather_base_`` that had returned, on one rank and not the other.

The file says where each node really was: ids are handed out when a node opens and the
observer writes a node when it closes, so on one thread the nodes open when a node opens are
the ones with a smaller id written after it, and its parent is the innermost of them.
`mend_parent_links` gives that parent (found with a stack per thread, backend ranges left out)
to every node whose recorded parent is a backend range or cannot have held it (opened after it,
or closed before it). Only traces with a backend range are walked (`file_order`): where no
backend thread ran, the links are the observer's own.

Pure trace code: raw nodes in, their parent links mended in place.
"""
from __future__ import annotations

BACKEND_PREFIXES = ("gloo:", "nccl:")
_ROOT_PREFIX = "[pytorch|profiler|execution_trace|"  # the process and thread roots


def _name(node: dict) -> str:
    name = node.get("name")
    return name if isinstance(name, str) else ""


def file_order(nodes: list) -> dict[int, int] | None:
    """Each node id's position in the file (``nodes`` as read), or None when the trace has no
    backend range (no backend thread ran beside the recorded one: nothing to mend)."""
    if not any(isinstance(n, dict) and _name(n).startswith(BACKEND_PREFIXES) for n in nodes):
        return None
    return {n["id"]: i for i, n in enumerate(nodes)
            if isinstance(n, dict) and type(n.get("id")) is int}


def mend_parent_links(nodes: list, flat: bool, position: dict[int, int]) -> int:
    """Give each node of ``nodes`` (raw nodes sorted by id, parent links acyclic; ``flat``: the
    1.0.1 layout) whose recorded parent is a backend range or cannot have held it the innermost
    node of its thread open when it opened; ``position`` is `file_order`'s. Returns how many
    links changed."""
    key = "parent" if flat else "ctrl_deps"
    by_id = {n["id"]: n for n in nodes}
    backend = {n["id"] for n in nodes if _name(n).startswith(BACKEND_PREFIXES)}
    roots = {n["id"] for n in nodes if _name(n).startswith(_ROOT_PREFIX)}
    root_of: dict[int, int] = {}
    stacks: dict[int, list[int]] = {}  # thread root -> ids of its open nodes, innermost last
    num_changed = 0
    for node in nodes:
        nid = node["id"]
        if nid in backend or nid in roots:
            continue
        parent = node.get(key)
        if type(parent) is not int:
            continue  # the loader names a malformed link
        stack = stacks.setdefault(_thread_root(nid, by_id, key, roots, root_of), [])
        while stack and position[stack[-1]] < position[nid]:
            stack.pop()  # closed before this node closed, so before it opened
        if stack and parent != stack[-1] and parent not in roots and \
                (parent in backend or _outside(nid, parent, position)):
            node[key] = stack[-1]
            num_changed += 1
        stack.append(nid)
    return num_changed


def _outside(nid: int, parent, position: dict[int, int]) -> bool:
    """Whether the recorded ``parent`` cannot have held ``nid``: it opened after it, or closed
    before it (a parent never written is left to the loader's orphans)."""
    return parent in position and (parent > nid or position[parent] < position[nid])


def _thread_root(nid: int, by_id: dict, key: str, roots: set[int],
                 root_of: dict[int, int]) -> int:
    """The root ``nid``'s recorded parent links lead to (its thread's), memoized."""
    path = []
    while nid not in root_of:
        path.append(nid)
        parent = by_id[nid].get(key)
        if type(parent) is not int or parent in roots or parent not in by_id or parent == nid:
            root_of[nid] = parent if type(parent) is int and parent in roots else nid
            break
        nid = parent
    root = root_of[nid]
    for seen in path:
        root_of[seen] = root
    return root
