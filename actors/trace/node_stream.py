"""A trace's nodes, read one at a time: the JSON is never held as one document of objects.

A rank's trace is one JSON object whose ``nodes`` list holds every recorded node; parsed whole,
the objects take 6-8x the file's bytes (a 757 MB pipeline stage peaked at 8.3 GiB). The
observer writes each node's id, name and parent link first (``{"id": N, "name": "...",
"ctrl_deps": P`` since schema 1.0.2; ``{"name": "...", "id": N, "rf_id": R, "parent": P`` in
1.0.1), so one regular expression, run over the bytes, finds where every node starts and reads
those three fields: the skeleton the loader sorts, checks and mends. A node's full object is
parsed from its own bytes only when the loader reaches it (`TraceNodes.full`) and let go after.
What is held is the skeleton; a plain JSON file is read where it lies (a node's bytes when they
are needed), a compressed one is inflated into memory first (its text, one byte a byte).

A document in any other layout (keys in another order, a node the expression does not see, a
node's text that does not parse to the node it was read as) is parsed whole instead, as before:
the same nodes and the same errors, only without the memory saved. Pure trace code.
"""
from __future__ import annotations

import os
import re
from array import array
from dataclasses import dataclass

import orjson

from actors.errors import TraceError
from actors.trace import archive
from actors.trace.source import as_source

_STR = rb'"([^"\\]*(?:\\.[^"\\]*)*)"'  # a JSON string's body (escapes kept)
_NODE_STARTS = (  # (parent key, the expression reading (id, name, parent) at a node's start)
    ("ctrl_deps", re.compile(rb'\{\s*"id"\s*:\s*(-?\d+)\s*,\s*"name"\s*:\s*' + _STR
                             + rb'\s*,\s*"ctrl_deps"\s*:\s*(-?\d+)')),
    ("parent", re.compile(rb'\{\s*"name"\s*:\s*' + _STR + rb'\s*,\s*"id"\s*:\s*(-?\d+)\s*,'
                          rb'(?:\s*"rf_id"\s*:\s*-?\d+\s*,)?\s*"parent"\s*:\s*(-?\d+)')),
)
_NODES_OPEN = re.compile(rb'"nodes"\s*:\s*\[\s*')
_CHUNK_BYTES = 16 << 20  # text scanned at a time
_MAX_HEAD_BYTES = 64 << 20  # the first node starts within this (else: another layout)
_MAX_TAIL_TRIES = 64  # ']' tried from the end for the one that closes the nodes list


class LayoutMismatch(Exception):
    """The text is not in the layout the skeleton reads: the document is parsed whole
    (`TraceNodes.parsed_whole`)."""


class _Text:
    """A trace's JSON text: ``read(start, end)`` returns those bytes."""

    def __init__(self, data: bytes | None = None, path: str | None = None):
        self._data = data
        self._fd = None if data is not None else os.open(path, os.O_RDONLY)
        self.size = len(data) if data is not None else os.fstat(self._fd).st_size

    def read(self, start: int, end: int) -> bytes:
        if self._data is not None:
            return self._data[start:end]
        return os.pread(self._fd, max(0, min(end, self.size) - start), start)

    def whole(self) -> bytes:
        return self._data if self._data is not None else self.read(0, self.size)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
        self._data = self._fd = None


@dataclass
class TraceNodes:
    """A trace's document with an empty ``nodes`` list in its place (``header``: written out
    again, the keys keep their order) and its nodes in file order (``nodes``): each a dict with
    at least ``id``, ``name`` and the parent key, whose full object `full` returns."""

    header: dict
    nodes: list
    parent_key: str = ""  # "ctrl_deps" or "parent" when ``nodes`` are skeletons
    _text: _Text | None = None  # the JSON text when ``nodes`` are skeletons
    _starts: array | None = None  # byte offset of each node's text, then where the last ends

    @property
    def streamed(self) -> bool:
        """Whether ``nodes`` are skeletons over the text (not a whole parse's objects)."""
        return self._text is not None

    def full(self, node: dict) -> dict:
        """The node's whole object, its parent link as the skeleton's (which may be mended).
        Raises `LayoutMismatch` when its text is not the node the skeleton read."""
        if self._text is None:
            return node
        at = node["_at"]
        text = self._text.read(self._starts[at], self._starts[at + 1]).rstrip()
        if at + 1 < len(self._starts) - 1:
            if not text.endswith(b","):
                raise LayoutMismatch
            text = text[:-1]
        try:
            raw = orjson.loads(text)
        except orjson.JSONDecodeError:
            raise LayoutMismatch from None
        if not isinstance(raw, dict) or raw.get("id") != node["id"] \
                or raw.get("name") != node["name"]:
            raise LayoutMismatch
        raw[self.parent_key] = node[self.parent_key]
        return raw

    def parsed_whole(self, source) -> "TraceNodes":
        """The same document parsed whole (after a `LayoutMismatch`)."""
        doc = _parse_whole(source, self._text.whole())
        self.release()
        return whole_nodes(doc)

    def release(self) -> None:
        """Let the text and the skeleton go (the loader holds what it built)."""
        self.nodes.clear()
        if self._text is not None:
            self._text.close()
        self._text = self._starts = None


def read_json(path, data: bytes | None = None) -> dict:
    """Read a trace's JSON whole: ``path`` is a file (plain, gzip, or a one-trace tar archive)
    or a `TraceSource` (which may name an archive member and carries the decompression limit).

    ``data`` are the stored bytes of the file or member when they arrived another way
    (Ray's object store).
    """
    source = as_source(path)
    return _parse_whole(source, source.read_json_bytes(data))


def read_nodes(path, data: bytes | None = None) -> TraceNodes:
    """A trace's nodes as skeletons over its text (see the module docstring); a document the
    skeleton cannot read is parsed whole. Arguments as `read_json`'s.

    A plain JSON file is read where it lies, each node's bytes when they are needed; a
    compressed file, an archive member or ``data`` is inflated into memory first."""
    source = as_source(path)
    if data is None and source.member is None and _is_plain(source):
        text = _Text(path=source.path)
    else:
        text = _Text(source.read_json_bytes(data))
    try:
        return _skeleton(text)
    except LayoutMismatch:
        try:
            return whole_nodes(_parse_whole(source, text.whole()))
        finally:
            text.close()


def over_nodes(path, body, data: bytes | None = None):
    """``body(TraceNodes)`` over the trace's nodes (`read_nodes`); when a node's text turns out
    not to be the node its skeleton read (`LayoutMismatch`), ``body`` runs again over the
    document parsed whole. The file is let go after, whatever happened."""
    source = as_source(path)
    read = read_nodes(source, data)
    try:
        try:
            return body(read)
        except LayoutMismatch:
            read = read.parsed_whole(source)
            return body(read)
    finally:
        read.release()


def _is_plain(source) -> bool:
    """Whether the file is uncompressed JSON within the size limit (else the whole-file
    reader says what is wrong with it)."""
    try:
        with open(source.path, "rb") as f:
            magic = f.read(2)
            return os.fstat(f.fileno()).st_size <= source.max_decompressed_bytes \
                and not archive.is_gzip(magic) and not _is_tar(f)
    except OSError:
        return False


def _is_tar(f) -> bool:
    f.seek(0)
    return archive.is_tar_bytes(f.read(263))


def whole_nodes(doc: dict) -> TraceNodes:
    """A document parsed whole, as `TraceNodes` (its nodes are their own full objects)."""
    nodes, doc["nodes"] = doc["nodes"], []
    return TraceNodes(doc, nodes)


def _parse_whole(source, text: bytes) -> dict:
    try:
        doc = orjson.loads(text)
    except orjson.JSONDecodeError as e:
        if text and e.pos >= len(text):
            raise TraceError(source, f"truncated JSON: the data ends at byte {len(text)} inside the "
                                     "document (was the file cut while being written or copied?)") from None
        raise TraceError(source, f"invalid JSON ({e}); expected an Execution Trace JSON object") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("nodes"), list):
        raise TraceError(source, "expected a JSON object with a 'nodes' list")
    return doc


def _skeleton(text: _Text) -> TraceNodes:
    """The skeleton of every node, scanning the text a chunk at a time."""
    head, opened, key, pattern = _head(text)
    first = opened.end()
    starts = array("q")
    nodes: list[dict] = []
    names: dict[bytes, str] = {}
    name_group = 2 if key == "ctrl_deps" else 1
    id_group = 3 - name_group
    pos, size = first, _CHUNK_BYTES
    while True:
        chunk = text.read(pos, pos + size)
        at_end = pos + len(chunk) >= text.size
        found = list(pattern.finditer(chunk))
        if not at_end:
            if len(found) < 2:  # a node longer than the chunk: read more of it
                size *= 2
                continue
            last = found.pop()  # its fields may run past the chunk: read again from its start
        for m in found:
            raw_name = m.group(name_group)
            name = names.get(raw_name)
            if name is None:
                name = names[raw_name] = _decode_name(raw_name)
            starts.append(pos + m.start())
            nodes.append({"id": int(m.group(id_group)), "name": name, key: int(m.group(3)),
                          "_at": len(nodes)})
        if at_end:
            break
        pos, size = pos + last.start(), _CHUNK_BYTES
    if not starts or starts[0] != first:
        raise LayoutMismatch
    end = _nodes_end(text, starts[-1])
    starts.append(end)
    header = orjson.loads(head[:opened.start()] + b'"nodes":[]' + text.read(end + 1, text.size))
    if not isinstance(header, dict) or header.get("nodes") != []:
        raise LayoutMismatch
    return TraceNodes(header, nodes, key, text, starts)


def _head(text: _Text):
    """``(head, the match opening the nodes list, parent key, node pattern)``: the text is
    read from its start until its first node's fields are in it."""
    size = _CHUNK_BYTES
    while True:
        head = text.read(0, size)
        opened = _NODES_OPEN.search(head)
        if opened is not None:
            for key, pattern in _NODE_STARTS:
                if pattern.match(head, opened.end()):
                    return head, opened, key, pattern
        if len(head) >= text.size or size >= _MAX_HEAD_BYTES:
            raise LayoutMismatch
        size *= 2


def _decode_name(raw: bytes) -> str:
    try:
        return orjson.loads(b'"' + raw + b'"') if b"\\" in raw else raw.decode()
    except (orjson.JSONDecodeError, UnicodeDecodeError):
        raise LayoutMismatch from None


def _nodes_end(text: _Text, last_start: int) -> int:
    """Where the ``]`` closing the nodes list is: the last node's text parses before it and
    the rest of the document after it."""
    tail = text.read(last_start, text.size)
    end = len(tail)
    for _ in range(_MAX_TAIL_TRIES):
        end = tail.rfind(b"]", 0, end)
        if end < 0:
            break
        try:
            if isinstance(orjson.loads(tail[:end]), dict):
                return last_start + end
        except orjson.JSONDecodeError:
            pass
    raise LayoutMismatch
