"""A trace's nodes read one at a time (actors/trace/node_stream.py): the skeleton read from the
text is the nodes' own id, name and parent, each node's object is the one a whole parse gives,
the loaded `Trace` is the same either way, and a document in another layout, or broken, is
parsed whole with the whole parse's errors."""
from __future__ import annotations

import gzip
import os
from pathlib import Path

import orjson
import pytest

from actors.errors import TraceError
from actors.trace import load_trace
from actors.trace import node_stream
from actors.trace.node_stream import read_json, read_nodes
from orchestrator.config import DEMO_TRACES
from tests.support.et_json import ADD, RELU, node, tensor, write_trace
from tests.support.trace_state import trace_state

DEMO_RANK0 = DEMO_TRACES / "gpt_dp_4" / "rank-0.et.json.gz"
TRACES = ["gpt_dp_4/rank-0.et.json.gz", "gpt_zero3_2/rank-1.et.json.gz",
          "public:linear_et.json.gz",  # the 1.0.1 layout: name, id, rf_id, parent
          "public:resnet_2gpu_et.json.gz"]


@pytest.fixture(params=TRACES)
def path(request) -> Path:
    """A demo trace, or a public one (skipped without the shared folder)."""
    if request.param.startswith("public:"):
        return request.getfixturevalue("public_trace_dir") / request.param.split(":", 1)[1]
    return DEMO_TRACES / request.param


def _whole(monkeypatch):
    """Make `read_nodes` parse every document whole (as the loader did before)."""
    def refuse(text):
        raise node_stream.LayoutMismatch
    monkeypatch.setattr(node_stream, "_skeleton", refuse)


def _plain(src: Path, tmp_path: Path, option=0) -> Path:
    """``src`` rewritten as plain JSON (orjson's compact text, or indented)."""
    out = tmp_path / (src.name.removesuffix(".gz").removesuffix(".json") + ".json")
    out.write_bytes(orjson.dumps(read_json(src), option=option))
    return out


def _skeleton_of(doc: dict) -> list[tuple]:
    key = "ctrl_deps" if "ctrl_deps" in doc["nodes"][0] else "parent"
    return [(n["id"], n["name"], n[key]) for n in doc["nodes"]]


def test_skeleton_and_objects_are_the_whole_parse(path):
    doc = read_json(path)
    read = read_nodes(path)
    assert read.streamed
    key = read.parent_key
    assert [(n["id"], n["name"], n[key]) for n in read.nodes] == _skeleton_of(doc)
    assert [read.full(n) for n in read.nodes] == doc["nodes"]
    assert list(read.header) == list(doc)  # the keys in their order, nodes in its place
    assert read.header == {**doc, "nodes": []}


def test_the_loaded_trace_is_the_same_as_from_a_whole_parse(path, tmp_path, monkeypatch):
    plain = _plain(path, tmp_path)  # read where it lies, a node's bytes at a time
    streamed = [trace_state(load_trace(p)) for p in (path, plain)]
    _whole(monkeypatch)
    whole = [trace_state(load_trace(p)) for p in (path, plain)]
    assert streamed == whole


def test_chunk_edges_and_indented_text_find_the_same_nodes(tmp_path, monkeypatch):
    src = DEMO_RANK0
    indented = _plain(src, tmp_path, orjson.OPT_INDENT_2)
    expected = _skeleton_of(read_json(src))
    monkeypatch.setattr(node_stream, "_CHUNK_BYTES", 97)  # fields cut at every chunk's edge
    read = read_nodes(indented)
    assert read.streamed
    assert [(n["id"], n["name"], n["ctrl_deps"]) for n in read.nodes] == expected
    assert read.full(read.nodes[-1]) == read_json(src)["nodes"][-1]


def test_escaped_names_and_lookalike_strings(tmp_path):
    nodes = [node(3, 'aten::add', inputs=[tensor(1, 1, 4), tensor(2, 2, 4)],
                  outputs=[tensor(3, 3, 4)], schema=ADD,
                  note='{"id": 9, "name": "fake", "ctrl_deps": 2, "x": [1]}'),
             node(4, 'module "q\u00e9"', parent=2)]
    path = write_trace(tmp_path, nodes)
    path.write_bytes(path.read_bytes().replace("é".encode(), b"\\u00e9"))
    read = read_nodes(path)
    assert read.streamed
    assert {"aten::add", 'module "qé"'} <= {n["name"] for n in read.nodes}
    assert [read.full(n) for n in read.nodes] == read_json(path)["nodes"]


def test_another_key_order_is_parsed_whole(tmp_path):
    path = write_trace(tmp_path, [node(3, "aten::relu", inputs=[tensor(1, 1, 4)],
                                       outputs=[tensor(2, 2, 4)], schema=RELU)])
    doc = orjson.loads(path.read_bytes())
    doc["nodes"] = [{"name": n["name"], **n} for n in doc["nodes"]]
    path.write_bytes(orjson.dumps(doc))
    read = read_nodes(path)
    assert not read.streamed
    assert [op.name for op in load_trace(path).ops] == ["aten::relu"]


@pytest.mark.parametrize("cut, message", [
    (lambda t: t.replace(b'},{"id":4', b'}{"id":4'), r"invalid JSON"),  # a comma missing
    (lambda t: t.replace(b'},{"id":4', b'},x{"id":4'), r"invalid JSON"),  # junk between nodes
    (lambda t: t[:-40], r"truncated JSON: the data ends at byte"),
], ids=["no-comma", "junk", "truncated"])
def test_broken_text_gets_the_whole_parse_error(tmp_path, cut, message):
    path = write_trace(tmp_path, [node(3, "aten::add", inputs=[tensor(1, 1, 4), tensor(2, 2, 4)],
                                       outputs=[tensor(3, 3, 4)], schema=ADD),
                                  node(4, "aten::relu", inputs=[tensor(3, 3, 4)],
                                       outputs=[tensor(4, 4, 4)], schema=RELU)])
    text = orjson.dumps(orjson.loads(path.read_bytes()))
    assert b'},{"id":4' in text
    for name, data in (("t.json", cut(text)), ("t.json.gz", gzip.compress(cut(text)))):
        broken = tmp_path / name
        broken.write_bytes(data)
        with pytest.raises(TraceError, match=message):
            load_trace(broken)


def test_a_refused_trace_lets_its_file_go(tmp_path):
    nodes = [node(3, "aten::relu", inputs=[tensor(1, 1, 4)], outputs=[tensor(2, 2, 4)],
                  schema=RELU),
             node(3, "aten::relu", inputs=[tensor(2, 2, 4)], outputs=[tensor(4, 4, 4)],
                  schema=RELU)]
    path = write_trace(tmp_path, nodes)
    read = read_nodes(path)
    assert read.streamed
    read.release()
    open_before = len(os.listdir("/proc/self/fd"))
    for _ in range(3):
        with pytest.raises(TraceError, match="node id 3 appears twice"):
            load_trace(path)
    assert len(os.listdir("/proc/self/fd")) == open_before


def test_a_node_start_inside_a_node_falls_back_to_the_whole_parse(tmp_path, monkeypatch):
    """A value that reads as a node's start splits a node in two: its text no longer parses
    to the node the skeleton read, and the load starts over on the document parsed whole."""
    nodes = [node(3, "aten::relu", inputs=[tensor(1, 1, 4)], outputs=[tensor(2, 2, 4)],
                  schema=RELU),
             node(4, "a range", parent=2)]
    path = write_trace(tmp_path, nodes)
    doc = orjson.loads(path.read_bytes())
    ranged = next(n for n in doc["nodes"] if n["name"] == "a range")
    ranged["inputs"]["values"] = [{"id": 99, "name": "inside", "ctrl_deps": 4}]
    path.write_bytes(orjson.dumps(doc))
    read = read_nodes(path)
    assert read.streamed and 99 in {n["id"] for n in read.nodes}  # the false start is seen
    read.release()
    streamed = trace_state(load_trace(path))
    _whole(monkeypatch)
    assert streamed == trace_state(load_trace(path))
