"""One failure report: the status by the exception's type, the fields by who wrote it, and a
collective past its group's timeout raised as a CollectiveTimeout."""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from actors.errors import CollectiveTimeout, TraceError
from actors.replay.comm.process_groups import ProcessGroups
from actors.replay.comm.replayer import CollectiveReplayer
from actors.replay.failure import FailureReport, status_of
from actors.replay.out_of_memory import OutOfMemory


@pytest.mark.parametrize("error,status", [
    (TimeoutError("x"), "timeout"), (CollectiveTimeout("x"), "timeout"),
    # the words alone do not make a timeout: the type does
    (RuntimeError("Timed out waiting"), "failed"), (TraceError("f", "bad"), "failed")])
def test_the_status_is_the_exception_type(error, status):
    assert status_of(error) == status


def test_the_rank_names_its_node_first_and_the_driver_last():
    op = SimpleNamespace(node_id=7, name="aten::mm")
    try:
        raise KeyError("")
    except KeyError as e:
        own = FailureReport.of_rank(3, e, "iteration", op, {"node_ip": "1.2.3.4", "node_id": "n"})
    d = own.to_dict()
    assert list(d) == ["rank", "node_ip", "node_id", "status", "error", "oom", "last_op",
                       "phase", "traceback"]
    assert d["status"] == "failed" and d["last_op"] == "node 7 aten::mm"
    assert d["error"].startswith("rank 3: KeyError: '' at node 7 aten::mm (phase iteration)")
    assert "test_failure_report.py" in d["traceback"]
    oom = FailureReport.of_rank(0, OutOfMemory(10, 20, 16), "compile").to_dict()
    assert oom["status"] == "oom" and oom["oom"]["requested_bytes"] == 20
    assert oom["error"].startswith("rank 0: out of memory before the first op")
    driver = FailureReport(rank=1, status="timeout", error="late", node_ip="ip").to_dict()
    assert list(driver) == ["rank", "status", "error", "last_op", "node_ip", "node_id"]
    assert list(FailureReport.missing(2, "failed").to_dict()) == ["rank", "status", "error",
                                                                   "last_op"]


@pytest.mark.parametrize("timeout_s,raised", [(0.0, CollectiveTimeout), (60.0, RuntimeError)])
def test_a_collective_error_past_the_timeout_is_a_collective_timeout(timeout_s, raised):
    groups = ProcessGroups(0, 2, {"0": object()}, {"0": (0, 1)}, timeout_s=timeout_s)
    comm = CollectiveReplayer(groups, torch.device("cpu"))
    op = SimpleNamespace(node_id=5, name="c10d::allreduce_",
                         collective=SimpleNamespace(kind="all_reduce"))

    def hung(*_):
        time.sleep(0.01)
        raise RuntimeError("[gloo] Timed out waiting 2000ms for recv")
    comm._run = hung
    with pytest.raises(raised) as info:
        comm.run(op, None)
    assert isinstance(info.value, RuntimeError)  # still what torch's callers catch
    assert status_of(info.value) == ("timeout" if raised is CollectiveTimeout else "failed")
    if raised is CollectiveTimeout:
        assert "node 5 (c10d::allreduce_, all_reduce)" in str(info.value)
