"""Malformed traces raise TraceError naming the file (and the node id where known); project
exceptions survive pickling (they cross process pools and Ray)."""
from __future__ import annotations

import gzip
import pickle

import orjson
import pytest

from actors.errors import ConfigError, ReplayError, TraceError, TracefleetError
from actors.replay.out_of_memory import OutOfMemory
from actors.trace import load_trace
from tests.support.et_json import RELU, ROOTS, node, side, tensor, tensor_list, write_trace
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


# --- what the fuzz campaign (scripts/fuzz_traces.py) found: each used to be a deep traceback

@pytest.mark.parametrize("value, match", [
    ([1, "1", 0, 4, 4, "cpu"], "four integers >= 0"),
    ([1, 1, -3, 4, 4, "cpu"], "four integers >= 0"),
    ([1, 1, 0, 4, 0, "cpu"], "an item size >= 1"),
    ([1, 1, 0, 4, 4, 7], "a device string"),
])
def test_a_malformed_tensor_tuple_names_the_node(tmp_path, value, match):
    op = _good_op()
    op["inputs"]["values"][0] = value
    _raises(write_trace(tmp_path, [op]), 3, match)


@pytest.mark.parametrize("shape", [[4, -1], [4, "4"], 4, [[4]]])
def test_a_malformed_tensor_shape_names_the_node(tmp_path, shape):
    op = _good_op()
    op["inputs"]["shapes"][0] = shape
    _raises(write_trace(tmp_path, [op]), 3, "tensor shape .* must be a list of sizes >= 0")


def test_tensor_lists_nested_past_python_recursion_are_refused(tmp_path):
    op = node(3, "aten::cat", inputs=[("DEEP", [[4]], "GenericList[Tensor(float)]")],
              outputs=[tensor(2, 2, 4)], schema="aten::cat(Tensor[] tensors, int dim=0) -> Tensor")
    path = write_trace(tmp_path, [op])  # orjson writes 254 levels at most: splice the rest in
    path.write_bytes(path.read_bytes().replace(
        b'"DEEP"', b"[" * 1000 + b'[1,1,0,4,4,"cpu"]' + b"]" * 1000))
    _raises(path, 3, "a tensor list nests deeper than 8 levels")


@pytest.mark.parametrize("field, value, match", [
    ("name", 7, "expected an integer, a string and an integer node id"),
    ("ctrl_deps", [2], "expected an integer, a string and an integer node id"),
    ("attrs", [{"name": "op_schema", "type": "string", "value": 5}], "malformed node"),
])
def test_node_fields_of_the_wrong_type_name_the_node(tmp_path, field, value, match):
    _raises(write_trace(tmp_path, [_good_op(**{field: value})]), 3, match)


def test_a_process_group_table_claiming_a_huge_world_is_refused(tmp_path):
    table = orjson.dumps([{"pg_name": "0", "pg_desc": "default_pg", "backend_config": "gloo",
                           "ranks": [], "group_size": 10**12}]).decode()
    pg = node(3, "## process_group:init ##", inputs=[(table, [], "String")])
    _raises(write_trace(tmp_path, [pg]), 3, "group_size 1000000000000 .* expected sizes and ranks "
                                            "from 0 to 1,048,576")


def test_a_collective_count_of_the_wrong_type_names_the_node(tmp_path):
    rpc = node(3, "record_param_comms", inputs=[tensor(1, 1, 4)], outputs=[tensor(1, 1, 4)],
               collective_name="allreduce", in_msg_nelems="four")
    _raises(write_trace(tmp_path, [rpc]), 3, "all_reduce: in_nelems 'four'; expected an integer")
