"""The capture's trace files rewritten a node at a time: the observer's file after the fake
mode's rewrites, and a role's trace written as its other ranks'.

A fake 405B pipeline stage records 757 MB of JSON; parsed whole it took 10.9 GiB to rewrite.
Here the file is read as `actors.trace.node_stream` reads it (a skeleton over the text), the
rewrites see each node with the fields they read and edit (id, name, parent, the op schema, the
inputs' and outputs' types and tensor values: `_slim`), and each node that stays is written
with their edits. Each node is parsed once: its compact text goes to a spool file beside the
output as it is read, and is copied from there when the rewrites left the node as it was. A
role's other ranks are written in one pass over the
recorded rank's nodes, each renamed per rank. The files are the same, byte for byte once
inflated, as the whole document's rewrite and dump wrote them.
"""
from __future__ import annotations

import gzip
import os
import sys
from array import array
from collections.abc import Callable

import orjson

from actors.capture.fake.group_names import PG_INIT, group_table, rank_renamer
from actors.errors import writing
from actors.gc_pause import gc_paused
from actors.trace.node_stream import TraceNodes, over_nodes

_AT = "_at"  # a slim node's position in the file (its full node's), for the writer
_WRITE_BYTES = 1 << 20  # nodes' text gathered per write into the gzip stream
# zlib's level 3 deflates a fake stage's 716 MB in 40% of level 6's time, into a 36% larger
# file (a cache entry); inflating it costs the same
TRACE_GZIP_LEVEL = 3
_INPUTS_EDITED = "c10d::"  # name_c10d_groups writes these ops' group arguments


def rewrite_file(raw_path: str, out_path: str, rewrite: Callable[[dict], object]) -> None:
    """``rewrite`` the observer's file ``raw_path`` (a document whose nodes are `_slim`'s,
    edited in place as the whole document was) and write the result gzipped to
    ``out_path``; removes ``raw_path``."""
    # millions of containers, no cycles: the cyclic GC would rescan them (3x the parse time)
    with gc_paused():
        over_nodes(raw_path, lambda read: _rewrite(read, out_path, rewrite))
    os.remove(raw_path)


def _rewrite(read: TraceNodes, out_path: str, rewrite: Callable[[dict], object]) -> None:
    doc = dict(read.header)
    spool_path = out_path + ".nodes"
    try:
        # Each node is parsed once: its compact text is spooled to disk as it is read, and a
        # node the rewrites left as it was is copied from there (parsing the observer's
        # indented text again was a third of the rewrite).
        with open(spool_path, "wb", buffering=_WRITE_BYTES) as spool:
            doc["nodes"], starts = _spooled(read, spool)
        rewrite(doc)
        kept, doc["nodes"] = doc["nodes"], []  # the header is written around the nodes
        with writing(out_path, "a rank trace"), \
                gzip.open(out_path, "wb", compresslevel=TRACE_GZIP_LEVEL) as dst, \
                open(spool_path, "rb", buffering=0) as spool:
            out = _NodeWriter(dst, doc)
            text = _ForwardReader(spool)
            for i, slim in enumerate(kept):
                kept[i] = None
                at = slim[_AT]
                compact = text.read(starts[at], starts[at + 1])
                recorded = read.nodes[at]  # its skeleton: the name and parent as written
                if slim["name"] == recorded["name"] \
                        and slim["ctrl_deps"] == recorded.get("ctrl_deps") \
                        and not slim["name"].startswith(_INPUTS_EDITED):
                    out.add_text(compact)
                else:
                    out.add(_edited(orjson.loads(compact), slim))
            out.close()
    finally:
        if os.path.exists(spool_path):
            os.remove(spool_path)


def _spooled(read: TraceNodes, spool) -> tuple[list[dict], array]:
    """``(slim nodes, where each node's compact text starts in spool and where the last
    ends)``, every node parsed once."""
    slims, starts = [], array("q", [0])
    size = 0
    for at, node in enumerate(read.nodes):
        full = read.full(node)
        slims.append(_slim(full, at))
        size += spool.write(orjson.dumps(full))
        starts.append(size)
    return slims, starts


class _ForwardReader:
    """Byte ranges of a file read in increasing order, a chunk at a time. (Mapping the file
    instead would count every page read as the process's resident memory: 700 MB on a 405B
    stage.)"""

    def __init__(self, f):
        self._f = f
        self._buf, self._at = b"", 0  # the chunk held and where it starts in the file

    def read(self, start: int, end: int) -> bytes:
        if start < self._at or end > self._at + len(self._buf):
            self._f.seek(start)
            self._buf, self._at = self._f.read(max(end - start, _WRITE_BYTES)), start
        return self._buf[start - self._at:end - self._at]


def write_as_ranks(src_path: str, check_table: Callable[[list[dict]], object],
                   targets: dict[str, tuple[list[dict], str]]) -> None:
    """Write the trace at ``src_path`` as other ranks of its role, in one pass over its nodes:
    ``targets`` maps each file to write to that rank's process-group table and what to call
    that rank in an error (group_names.py's ``rank_renamer``). ``check_table`` is given the
    trace's own table before anything is written (it raises to refuse it)."""
    if targets:
        with gc_paused():
            over_nodes(src_path, lambda read: _write_as_ranks(read, check_table, targets))


def _write_as_ranks(read: TraceNodes, check_table: Callable[[list[dict]], object],
                    targets: dict[str, tuple[list[dict], str]]) -> None:
    table = group_table(read.full(n) for n in read.nodes if n["name"] == PG_INIT)
    check_table(table)
    renames = [(path, rank_renamer(table, target, where))
               for path, (target, where) in targets.items()]
    files = []
    try:
        for path, _ in renames:
            files.append(gzip.open(path, "wb", compresslevel=TRACE_GZIP_LEVEL))
        outs = [(_NodeWriter(f, read.header), rename) for f, (_, rename) in zip(files, renames)]
        for node in read.nodes:
            full = read.full(node)
            for out, rename in outs:
                out.add(rename(full))
        for out, _ in outs:
            out.close()
    finally:
        for f in files:
            f.close()


class _NodeWriter:
    """Writes a document to ``dst`` a node at a time: ``header`` (with an empty ``nodes``
    list, where the nodes go), then each node `add` is given, compact as orjson dumps."""

    def __init__(self, dst, header: dict):
        text = orjson.dumps(header)
        assert text.count(b'"nodes":[]') == 1, "the header holds one empty nodes list"
        head, _, self._tail = text.partition(b'"nodes":[]')
        self._dst = dst
        self._parts = [head + b'"nodes":[']
        self._size = 0
        self._first = True

    def add(self, node: dict) -> None:
        self.add_text(orjson.dumps(node))

    def add_text(self, text: bytes) -> None:
        """Add a node given as its compact text (what `add` would write of it)."""
        self._parts.append(text if self._first else b"," + text)
        self._first = False
        self._size += len(text)
        if self._size >= _WRITE_BYTES:
            self._flush()

    def close(self) -> None:
        self._parts.append(b"]" + self._tail)
        self._flush()

    def _flush(self) -> None:
        self._dst.write(b"".join(self._parts))
        self._parts, self._size = [], 0


def _slim(raw: dict, at: int) -> dict:
    """What the fake mode's rewrites read and edit of a node (fake_mode.py's strip,
    subclass_frames.py, group_names.py's ``name_c10d_groups``): id, name, parent, the op
    schema, the inputs' and outputs' types and the values that may be tensors (six-item lists)
    or hold them (lists of lists); other values are None here and kept from the node's text.
    Strings that repeat (names, types, devices, schemas) are interned."""
    name = raw.get("name")
    return {"id": raw.get("id"), "name": sys.intern(name) if type(name) is str else name,
            "ctrl_deps": raw.get("ctrl_deps"), "inputs": _slim_side(raw.get("inputs")),
            "outputs": _slim_side(raw.get("outputs")),
            "attrs": [{**a, "value": _interned(a.get("value"))} for a in raw.get("attrs") or ()
                      if isinstance(a, dict) and a.get("name") == "op_schema"], _AT: at}


def _slim_side(side) -> dict:
    if not isinstance(side, dict):
        return {"values": [], "types": []}
    values = []
    for v in side.get("values") or ():
        if type(v) is not list or (len(v) != 6 and not any(type(x) is list for x in v)):
            v = None  # no tensor in it
        elif len(v) == 6 and type(v[5]) is str:
            v[5] = sys.intern(v[5])  # the device
        values.append(v)
    return {"values": values, "types": [_interned(t) for t in side.get("types") or ()]}


def _interned(value):
    return sys.intern(value) if type(value) is str else value


def _edited(full: dict, slim: dict) -> dict:
    """``full`` with the rewrites' edits of its slim node: name, parent, input values and
    types (a c10d op's group named)."""
    for key in ("name", "ctrl_deps"):
        if full.get(key) != slim[key]:
            full[key] = slim[key]
    inputs = full.get("inputs")
    if isinstance(inputs, dict) and inputs.get("types") != slim["inputs"]["types"]:
        inputs["values"] = [f if s is None else s
                            for s, f in zip(slim["inputs"]["values"], inputs.get("values") or [])]
        inputs["types"] = slim["inputs"]["types"]
    return full
