"""The fake capture's record of the run's frees (actors/capture/fake/free_markers.py) as the ET
observer writes it: one ``tracefleet::freed`` op naming the freed storages, nothing else."""
from __future__ import annotations

import json

import torch
from torch.profiler import ExecutionTraceObserver

from actors.capture.fake import free_markers, meta_storage
from actors.gc_pause import gc_paused
from actors.capture.fake.fake_mode import CaptureFakeMode
from actors.trace.conventions import FREED_OP


def test_freed_storages_are_one_op_and_their_views_are_not_recorded(tmp_path):
    path = tmp_path / "trace.json"
    with meta_storage.unique_meta_storages(), meta_storage.record_frees():
        free_markers._freed_op()  # defined before the observer starts, as recording() does
        held = [torch.empty(1024, device="meta") for _ in range(3)]
        del held  # three frees pending
        observer = ExecutionTraceObserver()
        observer.register_callback(str(path))
        observer.start()
        free_markers.emit()
        after = torch.empty(8, device="meta") + 1  # recording is on again after emit()
        observer.stop()
        observer.unregister_callback()
    names = [n["name"] for n in json.loads(path.read_text())["nodes"]
             if not n["name"].startswith("[pytorch")]
    freed = [n for n in json.loads(path.read_text())["nodes"] if n["name"] == FREED_OP]
    assert len(freed) == 1 and len(freed[0]["inputs"]["values"][0]) == 3
    assert names[0] == FREED_OP and "aten::set_" not in names, names  # no view of its own
    assert "aten::add" in names  # the observer records again after emit()
    assert after.shape == (8,)


def _recorded(path, run) -> list[dict]:
    """The nodes of ``run()`` recorded on fake with the run's frees written, as a capture
    does (its GC paused: garbage an earlier test left is not collected in the middle)."""
    with gc_paused(), meta_storage.unique_meta_storages(), CaptureFakeMode() as mode:
        observer = ExecutionTraceObserver()
        observer.register_callback(str(path))
        with free_markers.recording(mode):
            observer.start()
            run()
            observer.stop()
        observer.unregister_callback()
    return json.loads(path.read_text())["nodes"]


def _frees_of_adds_input(nodes: list[dict]) -> list[dict]:
    """The free markers naming the storage ``aten::add`` read (``a`` in the tests below)."""
    add = next(n for n in nodes if n["name"] == "aten::add")
    storage = add["inputs"]["values"][0][1]
    return [n for n in nodes if n["name"] == FREED_OP
            and any(t[1] == storage for t in n["inputs"]["values"][0])]


def test_a_free_before_a_metadata_query_is_written_between_the_ops(tmp_path):
    """A FakeTensor's device is dispatched (C++ reads it before most ops); the mode answers
    it at once, and still writes the frees pending there, before the next op's node: written
    inside that op instead, they would be read as that op's, an op later."""
    def run():
        a = torch.ones(256)
        b = a + 1
        del a
        assert torch.ops.prim.device(b) == torch.device("cpu")
        b.mul(2)

    nodes = _recorded(tmp_path / "trace.json", run)
    mul = next(n for n in nodes if n["name"] == "aten::mul")
    freed = _frees_of_adds_input(nodes)
    assert len(freed) == 1
    # before mul, not inside it
    assert freed[0]["ctrl_deps"] != mul["id"] and freed[0]["id"] < mul["id"]


def test_a_free_before_an_op_on_a_tensor_subclass_is_written_before_it(tmp_path):
    """An op on a tensor subclass (TwoTensor, as DTensor) is handed to the subclass before the
    mode's own work; the frees pending are written at that op, not inside its local ops."""
    from torch.testing._internal.two_tensor import TwoTensor

    def run():
        a = torch.ones(256)
        pair = TwoTensor(torch.ones(8), torch.ones(8))
        b = a + 1
        del a
        pair.mul(2)
        return b

    nodes = _recorded(tmp_path / "trace.json", run)
    by_id = {n["id"]: n for n in nodes}
    outer, *local = sorted((n for n in nodes if n["name"] == "aten::mul"), key=lambda n: n["id"])
    freed = _frees_of_adds_input(nodes)
    assert len(local) == 2 and len(freed) == 1  # the pair's two local muls; a's one free
    assert by_id[freed[0]["ctrl_deps"]]["ctrl_deps"] == outer["id"]  # in the outer op's frame
    assert freed[0]["id"] < min(n["id"] for n in local)
