"""The local Ray cluster's start: Ray's own node-start bound, missed on a loaded machine, is
tried again within cluster.timeout_s (at least twice), then a ClusterError in one line (it was an
internal error with a traceback)."""
from __future__ import annotations

import pytest
import ray

from orchestrator.cluster import connect as connect_module
from orchestrator.config import ClusterConfig
from orchestrator.errors import ClusterError

TIMED_OUT = ("The current node timed out during startup. This could happen because some of "
             "the raylet failed to startup or the GCS has become overloaded.")


def test_a_node_start_timeout_is_tried_again_then_a_cluster_error(monkeypatch, tmp_path):
    calls, clock = [], [0.0]

    def init(**kwargs):
        calls.append(kwargs)
        clock[0] += 31.0  # each attempt spends Ray's own 30 s bound
        raise Exception(TIMED_OUT)  # what Ray 2.60's node.py raises

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    monkeypatch.setattr(connect_module.time, "monotonic", lambda: clock[0])
    # attempts until cluster.timeout_s is spent: 100 s holds 4 of 31 s (the 4th ends at 124 s)
    with pytest.raises(ClusterError, match=r"the local Ray cluster did not start \(The current "
                                           r"node timed out.*\) in 4 attempts within "
                                           r"cluster.timeout_s=100 s; the machine may be "
                                           r"overloaded"):
        connect_module.connect(ClusterConfig(temp_dir=str(tmp_path / "ray"), timeout_s=100), 2)
    assert len(calls) == 4
    # a bound shorter than one attempt still tries twice
    calls.clear()
    with pytest.raises(ClusterError, match=r"in 2 attempts within cluster.timeout_s=1 s"):
        connect_module.connect(ClusterConfig(temp_dir=str(tmp_path / "ray"), timeout_s=1), 2)
    assert len(calls) == connect_module.MIN_LOCAL_START_ATTEMPTS == 2

    def other(**kwargs):  # any other failure is not retried
        calls.append(kwargs)
        raise RuntimeError("something else")

    calls.clear()
    monkeypatch.setattr(ray, "init", other)
    with pytest.raises(RuntimeError, match="something else"):
        connect_module.connect(ClusterConfig(temp_dir=str(tmp_path / "ray")), 2)
    assert len(calls) == 1
