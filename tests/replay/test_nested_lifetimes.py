"""Memory only nested ops touched is held from its nested allocation (faithful mode)."""
from __future__ import annotations

import orjson

from actors.replay.config import AllocationConfig, ReplayConfig
from actors.replay.engine import ReplayEngine
from actors.trace import load_trace
from actors.trace.tensor_ids import UNIQUE_STORAGES_KEY
from tests.support.et_json import ADD, node, tensor, write_trace

NEG = "aten::neg(Tensor self) -> Tensor"
N = 1024  # float elements: 4 KiB per tensor


def _trace(tmp_path, unique: bool):
    # op 0 (node 3) runs a nested neg (node 4) that allocates storage 90 and keeps it;
    # op 1 (node 5) is unrelated; op 2 (node 6) reads storage 90 (made inside op 0);
    # op 3 (node 7) runs a nested neg (node 8) that allocates storage 95, only read by the
    # nested add (node 11) inside op 5 (node 10): no top-level op ever sees storage 95
    nodes = [node(3, "aten::composite", inputs=[tensor(1, 10, N)], outputs=[tensor(2, 20, N)],
                  schema=NEG),
             node(4, "aten::neg", parent=3, inputs=[tensor(1, 10, N)],
                  outputs=[tensor(9, 90, N)], schema=NEG),
             node(5, "aten::neg", inputs=[tensor(1, 10, N)], outputs=[tensor(3, 30, N)],
                  schema=NEG),
             node(6, "aten::add", inputs=[tensor(9, 90, N), tensor(3, 30, N)],
                  outputs=[tensor(4, 40, N)], schema=ADD),
             node(7, "aten::composite", inputs=[tensor(4, 40, N)], outputs=[tensor(5, 50, N)],
                  schema=NEG),
             node(8, "aten::neg", parent=7, inputs=[tensor(4, 40, N)],
                  outputs=[tensor(12, 95, N)], schema=NEG),
             node(9, "aten::neg", inputs=[tensor(5, 50, N)], outputs=[tensor(6, 60, N)],
                  schema=NEG),
             node(10, "aten::composite", inputs=[tensor(6, 60, N)], outputs=[tensor(7, 70, N)],
                  schema=NEG),
             node(11, "aten::add", parent=10, inputs=[tensor(12, 95, N), tensor(6, 60, N)],
                  outputs=[tensor(13, 97, N)], schema=ADD)]
    path = write_trace(tmp_path, nodes)
    if unique:
        doc = orjson.loads(path.read_bytes())
        doc[UNIQUE_STORAGES_KEY] = True
        path.write_bytes(orjson.dumps(doc))
    return load_trace(path)


def test_lifetimes_of_a_made_inside_and_a_hidden_storage(tmp_path):
    trace = _trace(tmp_path, unique=True)
    made = trace.ops[2].input_tensors()[0].suid
    assert made in trace.made_inside
    assert trace.nested_lifetimes == ((made, 0, 2, 4 * N), (-1, 3, 5, 4 * N))
    # where addresses may be reused, a storage no top-level op sees is not followed
    assert _trace(tmp_path, unique=False).nested_lifetimes == ((made, 0, 2, 4 * N),)


def test_faithful_holds_them_from_their_nested_allocation(tmp_path):
    trace = _trace(tmp_path, unique=True)
    peaks = {}
    for mode in ("faithful", "lazy"):
        report = ReplayEngine(trace, ReplayConfig(
            mode="compute", device="meta", iters=1, warmup_iters=0, measure_memory=False,
            allocation=AllocationConfig(mode=mode))).run().to_dict()
        assert report["status"] == "ok", report["error"]
        peaks[mode] = report
    faithful = peaks["faithful"]
    # at op 1 the original held: the input, op 0's output, op 1's output and storage 90
    assert faithful["accounted_peak_bytes"] >= 4 * 4 * N
    assert faithful["peak_breakdown"]["made_inside"] >= 4 * N
    assert faithful["nested_memory"]["num_lifetimes"] == 2
    assert "nested_memory" not in peaks["lazy"]  # lazy holds only what top-level ops use
