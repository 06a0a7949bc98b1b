"""The fake capture's record of the run's frees (actors/capture/fake/free_markers.py) as the ET
observer writes it: one ``tracefleet::freed`` op naming the freed storages, nothing else."""
from __future__ import annotations

import json

import torch
from torch.profiler import ExecutionTraceObserver

from actors.capture.fake import free_markers, meta_storage
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
