"""Malformed traces raise TraceError naming the file (and the node id where known); project
exceptions survive pickling (they cross process pools and Ray)."""
from __future__ import annotations

import gzip
import pickle

import orjson
import pytest

from actors.errors import ConfigError, ReplayError, TraceError, TracefleetError
from actors.replay.memory import OutOfMemory
from actors.trace import load_trace
from tests.et_json import RELU, ROOTS, node, side, tensor, tensor_list, write_trace
from orchestrator.errors import ClusterError


def _good_op(nid=3, **overrides):
    n = node(nid, "aten::relu", inputs=[tensor(1, 1, 4)], outputs=[tensor(2, 2, 4)], schema=RELU)
    n.update(overrides)
    return n


def _raises(path, node_id=None, match=""):
    with pytest.raises(TraceError, match=match) as err:
        load_trace(path)
    assert err.value.path == str(path) and str(err.value).startswith(str(path))
    if node_id is not None:
        assert err.value.node_id == node_id and f"node {node_id}:" in str(err.value)
    return err.value


def test_truncated_json(tmp_path):
    whole = write_trace(tmp_path, [_good_op()]).read_bytes()
    path = tmp_path / "cut.json"
    path.write_bytes(whole[:len(whole) // 2])
    _raises(path, match=f"truncated JSON: the data ends at byte {len(whole) // 2}")


def test_truncated_gzip(tmp_path):
    blob = gzip.compress(write_trace(tmp_path, [_good_op()]).read_bytes())
    path = tmp_path / "cut.json.gz"
    path.write_bytes(blob[:len(blob) // 2])
    _raises(path, match="truncated or corrupt compressed file")


def test_truncated_json_inside_gzip(tmp_path):
    whole = write_trace(tmp_path, [_good_op()]).read_bytes()
    path = tmp_path / "cut-inside.json.gz"
    path.write_bytes(gzip.compress(whole[:-3]))
    _raises(path, match="truncated JSON")


@pytest.mark.parametrize("data", [b'{"schema": "1.1.1", "nodes": [}', b"not json", b""])
def test_invalid_json(tmp_path, data):
    path = tmp_path / "bad.json"
    path.write_bytes(data)
    _raises(path, match="invalid JSON")


def test_not_a_trace_and_missing_file(tmp_path):
    path = tmp_path / "list.json"
    path.write_bytes(b"[1, 2]")
    _raises(path, match="'nodes' list")
    _raises(tmp_path / "absent.json", match="cannot read")


@pytest.mark.parametrize("schema, match", [("2.0.0", "unsupported schema '2.0.0'"),
                                           ("1.2.0-chakra.0.0.4", "unsupported schema"),
                                           ("1.0.0", "unsupported schema"),
                                           (None, "missing or malformed 'schema'"),
                                           ("chakra", "missing or malformed 'schema'")])
def test_unknown_schema(tmp_path, schema, match):
    doc = {"pid": 1, "nodes": ROOTS}
    if schema is not None:
        doc["schema"] = schema
    path = tmp_path / "s.json"
    path.write_bytes(orjson.dumps(doc))
    _raises(path, match=match)


@pytest.mark.parametrize("field", ["name", "ctrl_deps", "inputs", "outputs"])
def test_node_missing_a_required_field(tmp_path, field):
    bad = _good_op(7)
    del bad[field]
    _raises(write_trace(tmp_path, [bad]), node_id=7, match=f"missing required field '{field}'")


def test_node_without_id(tmp_path):
    bad = _good_op(7)
    del bad["id"]
    _raises(write_trace(tmp_path, [bad]), match="a node has no integer 'id'")


def test_node_with_malformed_attrs(tmp_path):
    _raises(write_trace(tmp_path, [_good_op(6, attrs=["op_schema"])]), node_id=6, match="'attrs'")


@pytest.mark.parametrize("value", [[1, 1, 0, 4, 4], [1, 1, 0, 4, 4, "cpu", 0], 17])
def test_tensor_of_the_wrong_arity(tmp_path, value):
    bad = _good_op(9, inputs=side([(value, [4], "Tensor(float)")]))
    _raises(write_trace(tmp_path, [bad]), node_id=9, match="must have 6 entries")


def test_tensor_of_the_wrong_arity_in_a_list(tmp_path):
    good, short = tensor(1, 1, 4), ([5, 5, 0, 4, 4], [4], "Tensor(float)")
    bad = _good_op(11, inputs=side([tensor_list(good, short)]))
    _raises(write_trace(tmp_path, [bad]), node_id=11, match="must have 6 entries")


def test_values_types_mismatch(tmp_path):
    bad = _good_op(10)
    bad["inputs"]["types"].append("Int")
    _raises(write_trace(tmp_path, [bad]), node_id=10, match="different lengths")


@pytest.mark.parametrize("value", ["[{\"pg_name\": ", "[{\"pg_desc\": \"default_pg\"}]", "[3]"])
def test_malformed_pg_init(tmp_path, value):
    pg = node(3, "## process_group:init ##", inputs=[(value, [], "String")])
    _raises(write_trace(tmp_path, [pg, _good_op(4)]), node_id=3, match="process-group table")


def test_unknown_collective_name(tmp_path):
    rpc = node(5, "record_param_comms", inputs=[tensor(1, 1, 4), (3, [], "Int")],
               collective_name="all_shuffle")
    _raises(write_trace(tmp_path, [rpc]), node_id=5, match="unknown record_param_comms collective_name")


@pytest.mark.parametrize("error", [
    TraceError("/data/rank-3.json", "tensor value [1] must have 6 entries", 42),
    TraceError("/data/rank-3.json", "truncated JSON"),
    TracefleetError("any"), ReplayError("strict shape mismatch at node 7"),
    ConfigError("world_size 3 but 4 rank files"), ClusterError("no Ray cluster at 10.0.0.1:6379"),
    OutOfMemory(1024, 4096, 2048),
], ids=lambda e: type(e).__name__)
def test_project_exceptions_pickle(error):
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is type(error) and str(back) == str(error) and back.args == error.args
    if isinstance(error, OutOfMemory):
        assert (back.held_bytes, back.requested_bytes, back.capacity_bytes) == (1024, 4096, 2048)
    if isinstance(error, TraceError):
        assert (back.path, back.node_id, back.detail) == (error.path, error.node_id, error.detail)
