"""The broken-trace set (issue 24: cyclic parents, duplicate ids, huge or negative shapes,
retyped inputs, short tensor tuples) is a TraceError naming the node, on hand-written traces
and on mutations of a demo trace; the unmutated traces load as before
(actors/trace/integrity.py)."""
from __future__ import annotations

import copy

import orjson
import pytest

from actors.errors import TraceError
from actors.trace import load_trace
from actors.trace.node_stream import read_json
from orchestrator.config import DEMO_TRACES
from tests.support.et_json import ADD, EMBEDDING, RELU, node, scalar, tensor, write_trace

DEMO_RANK0 = DEMO_TRACES / "gpt_dp_4" / "rank-0.et.json.gz"


def _chain(parent_of_relu: int = 3):
    return [node(3, "aten::add", inputs=[tensor(1, 1, 4), tensor(2, 2, 4), scalar(1)],
                 outputs=[tensor(3, 3, 4)], schema=ADD),
            node(4, "aten::relu", parent=parent_of_relu, inputs=[tensor(3, 3, 4)],
                 outputs=[tensor(4, 4, 4)], schema=RELU)]


def test_a_clean_chain_loads(tmp_path):
    assert [op.name for op in load_trace(write_trace(tmp_path, _chain(2))).ops] == \
        ["aten::add", "aten::relu"]


def test_duplicate_node_ids(tmp_path):
    nodes = _chain(2) + [node(4, "aten::relu", inputs=[tensor(3, 3, 4)],
                              outputs=[tensor(5, 5, 4)], schema=RELU)]
    with pytest.raises(TraceError, match=r'node 4: node id 4 appears twice \(as "aten::relu" '
                                         r'and "aten::relu"\); expected one node per id'):
        load_trace(write_trace(tmp_path, nodes))


def test_a_parent_cycle(tmp_path):
    nodes = _chain(2)
    nodes[0]["ctrl_deps"] = 4  # add under relu, relu under add
    nodes[1]["ctrl_deps"] = 3
    with pytest.raises(TraceError, match=r"node 3: parent links form a cycle \(3 -> 4 -> 3\); "
                                         "expected a tree under the process root"):
        load_trace(write_trace(tmp_path, nodes))


def test_a_node_that_is_its_own_parent(tmp_path):
    nodes = _chain(2)
    nodes[1]["ctrl_deps"] = 4
    with pytest.raises(TraceError, match=r'node 4: "aten::relu" is its own parent; only the '
                                         "process root may be"):
        load_trace(write_trace(tmp_path, nodes))


@pytest.mark.parametrize("shape, held", [([10**12, 10**12], "1,000,000,000,000,000,000,000,000"),
                                         ([2, 3], "6")])
def test_a_shape_that_contradicts_numel(tmp_path, shape, held):
    nodes = [node(3, "aten::relu", inputs=[tensor(1, 1, 4, shape=shape)],
                  outputs=[tensor(2, 2, 4)], schema=RELU)]
    with pytest.raises(TraceError, match=rf"node 3: aten::relu input #0: shape "
                                         rf"\[{shape[0]},{shape[1]}\] holds {held} elements, "
                                         r"its tensor value records numel 4"):
        load_trace(write_trace(tmp_path, nodes))


def test_an_input_whose_type_contradicts_the_schema(tmp_path):
    value, shape, _ = tensor(1, 1, 4)
    nodes = [node(3, "aten::relu", inputs=[(value, shape, "Int")], outputs=[tensor(2, 2, 4)],
                  schema=RELU)]
    with pytest.raises(TraceError, match=r"node 3: aten::relu input #0: the op schema takes a "
                                         r"Tensor, the trace records Int \[1,1,0,4,4,\"cpu\"\]"):
        load_trace(write_trace(tmp_path, nodes))
    # and a tensor where the schema takes an int (embedding's padding_idx)
    nodes = [node(3, "aten::embedding", inputs=[tensor(1, 1, 80, shape=[10, 8]),
                                                tensor(2, 2, 4, "long int"), tensor(5, 5, 1)],
                  outputs=[tensor(3, 3, 32, shape=[4, 8])], schema=EMBEDDING)]
    with pytest.raises(TraceError, match=r"aten::embedding input #2: the op schema takes a "
                                         "SymInt, the trace records a tensor"):
        load_trace(write_trace(tmp_path, nodes))


def _mutated(tmp_path, mutate) -> str:
    """The demo's rank 0 with ``mutate(nodes by id, the first top-level aten::mm)`` applied."""
    doc = read_json(DEMO_RANK0)
    top = {op.node_id for op in load_trace(DEMO_RANK0).ops}
    by_id = {n["id"]: n for n in doc["nodes"]}
    mm = min((n for n in doc["nodes"] if n["name"] == "aten::mm" and n["id"] in top),
             key=lambda n: n["id"])
    mutate(doc, by_id, mm)
    path = tmp_path / "rank-0.et.json"
    path.write_bytes(orjson.dumps(doc))
    return str(path)


def _cycle(doc, by_id, mm):
    nested = min((n for n in doc["nodes"] if n["name"] == "aten::mm" and n["id"] != mm["id"]
                  and by_id[n["ctrl_deps"]]["name"] == "aten::matmul"), key=lambda n: n["id"])
    by_id[nested["ctrl_deps"]]["ctrl_deps"] = nested["id"]  # matmul under its own mm


def _set(field, value):
    def mutate(doc, by_id, mm):
        mm["inputs"][field][0] = value(mm["inputs"][field][0])
    return mutate


@pytest.mark.parametrize("name, mutate, message", [
    ("cyclic parents", _cycle, "parent links form a cycle"),
    ("duplicate id", lambda doc, by_id, mm: doc["nodes"].append(copy.deepcopy(mm)),
     "appears twice"),
    ("huge shape", _set("shapes", lambda s: [10**12, 10**12]), "holds 1,000,000,000,000,000"),
    ("negative shape", _set("shapes", lambda s: [-3, 4]), "must be a list of sizes >= 0"),
    ("retyped input", _set("types", lambda t: "Int"), "the op schema takes a Tensor"),
    ("short tensor tuple", _set("values", lambda v: v[:5]), "must have 6 entries"),
])
def test_the_broken_demo_set_names_the_node(tmp_path, name, mutate, message):
    path = _mutated(tmp_path, mutate)
    with pytest.raises(TraceError, match=message) as err:
        load_trace(path)
    assert err.value.node_id is not None and str(err.value).startswith(f"{path}, node ")


def test_every_demo_trace_passes_the_checks():
    for path in sorted(DEMO_TRACES.glob("*/rank-*.et.json.gz")):
        assert load_trace(path).ops
