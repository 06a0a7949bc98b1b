"""Storage generations where the trace shows new memory on a reused storage id."""
from __future__ import annotations

from actors.trace import load_trace
from tests.support.et_json import ADD, node, tensor, write_trace

TO = ("aten::to.dtype(Tensor(a) self, ScalarType dtype, bool non_blocking=False, "
      "bool copy=False, MemoryFormat? memory_format=None) -> Tensor(a)")
NEG = "aten::neg(Tensor self) -> Tensor"
MUL = "aten::mul.Tensor(Tensor self, Tensor other) -> Tensor"


def test_a_converting_op_on_a_reused_storage_id_makes_a_new_generation(tmp_path):
    # storage 20 holds a tensor used up by node 4; node 5's aten::to (a "may alias" schema)
    # returns a new tensor on storage 20 again: new memory, not the old tensor
    nodes = [node(3, "aten::neg", inputs=[tensor(1, 10, 64)], outputs=[tensor(2, 20, 64)],
                  schema=NEG),
             node(4, "aten::add", inputs=[tensor(2, 20, 64), tensor(1, 10, 64)],
                  outputs=[tensor(3, 30, 64)], schema=ADD),
             node(5, "aten::to", inputs=[tensor(3, 30, 64)],
                  outputs=[tensor(4, 20, 64)], schema=TO),
             node(6, "aten::to", inputs=[tensor(4, 20, 64)], outputs=[tensor(4, 20, 64)],
                  schema=TO)]
    ops = load_trace(write_trace(tmp_path, nodes)).ops
    first = ops[0].output_tensors()[0].suid
    converted = ops[2].output_tensors()[0].suid
    assert converted != first
    assert ops[3].output_tensors()[0].suid == converted  # a no-op to() returns its input


def test_a_storage_a_nested_op_made_again_starts_a_new_generation(tmp_path):
    nodes = [node(3, "aten::neg", inputs=[tensor(1, 10, 64)], outputs=[tensor(2, 20, 64)],
                  schema=NEG),
             node(4, "aten::add", inputs=[tensor(2, 20, 64), tensor(1, 10, 64)],
                  outputs=[tensor(3, 30, 64)], schema=ADD),
             # a composite op whose nested neg allocates on storage 20 and keeps it inside
             node(5, "aten::composite", inputs=[tensor(3, 30, 64)], outputs=[tensor(5, 40, 64)],
                  schema=NEG),
             node(6, "aten::neg", parent=5, inputs=[tensor(3, 30, 64)],
                  outputs=[tensor(6, 20, 64)], schema=NEG),
             node(7, "aten::mul", inputs=[tensor(6, 20, 64), tensor(5, 40, 64)],
                  outputs=[tensor(7, 50, 64)], schema=MUL)]
    trace = load_trace(write_trace(tmp_path, nodes))
    old = trace.ops[0].output_tensors()[0].suid
    remade = trace.ops[3].input_tensors()[0].suid
    assert remade != old
    assert remade in trace.made_inside
    assert old not in trace.made_inside


def test_a_capture_without_address_reuse_keeps_a_handed_back_tensor_in_its_generation(tmp_path):
    """Fake captures never reuse an address: a fresh return on a storage already seen is that
    allocation handed back (selective AC's kept matmul output in the recompute), so it stays
    one generation from forward to backward; without the trace's marker it would split."""
    import orjson

    from actors.trace.tensor_ids import UNIQUE_STORAGES_KEY

    nodes = [node(3, "aten::neg", inputs=[tensor(1, 10, 64)], outputs=[tensor(2, 20, 64)],
                  schema=NEG),
             node(4, "aten::neg", inputs=[tensor(2, 20, 64)], outputs=[tensor(3, 30, 64)],
                  schema=NEG),
             node(5, "aten::neg", inputs=[tensor(1, 10, 64)], outputs=[tensor(2, 20, 64)],
                  schema=NEG)]
    path = write_trace(tmp_path, nodes)
    split = load_trace(path).ops
    assert split[2].output_tensors()[0].suid != split[0].output_tensors()[0].suid
    doc = orjson.loads(path.read_bytes())
    doc[UNIQUE_STORAGES_KEY] = True
    path.write_bytes(orjson.dumps(doc))
    kept = load_trace(path).ops
    assert kept[2].output_tensors()[0].suid == kept[0].output_tensors()[0].suid
