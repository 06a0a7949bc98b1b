"""The record of a sweep's embedded Ray cluster, and stopping what a killed sweep left running
(orchestrator/cluster/stale_cluster.py), with plain processes standing in for Ray's."""
from __future__ import annotations

import subprocess
import sys

import orjson
import psutil
import pytest

from orchestrator.cluster import stale_cluster


@pytest.fixture
def sleepers():
    """Two long-sleeping processes of this test; killed by PID at the end if still there."""
    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
             for _ in range(2)]
    yield procs
    for proc in procs:
        proc.kill()
        proc.wait(timeout=10)


def _dead_driver() -> dict:
    proc = subprocess.Popen(["true"])
    identity = {"pid": proc.pid, "create_time": psutil.Process(proc.pid).create_time()}
    proc.wait()
    return identity


def test_reap_stops_the_recorded_processes_of_a_dead_driver(tmp_path, sleepers):
    path = tmp_path / stale_cluster.RECORD_NAME
    stale_cluster.record(path, [psutil.Process(p.pid) for p in sleepers])
    data = orjson.loads(path.read_bytes())
    data["driver"] = _dead_driver()  # as if the driver had been SIGKILLed
    path.write_bytes(orjson.dumps(data))
    assert sorted(stale_cluster.reap(path)) == sorted(p.pid for p in sleepers)
    assert all(p.wait(timeout=10) is not None for p in sleepers)
    assert not path.exists()
    assert stale_cluster.reap(path) == []  # nothing recorded: nothing to do


def test_reap_spares_a_live_driver_and_a_reused_pid(tmp_path, sleepers):
    path = tmp_path / stale_cluster.RECORD_NAME
    stale_cluster.record(path, [psutil.Process(p.pid) for p in sleepers])
    assert stale_cluster.reap(path) == []  # this process, the driver, still runs
    assert path.exists() and all(p.poll() is None for p in sleepers)
    data = orjson.loads(path.read_bytes())
    data["driver"] = _dead_driver()
    data["processes"][0]["create_time"] -= 100  # its pid now belongs to another process
    path.write_bytes(orjson.dumps(data))
    assert stale_cluster.reap(path) == [sleepers[1].pid]
    assert sleepers[0].poll() is None


def test_forget_and_an_unreadable_record(tmp_path):
    path = tmp_path / stale_cluster.RECORD_NAME
    path.write_bytes(b'{"driver": {"pid"')  # a record cut short
    assert stale_cluster.reap(path) == [] and not path.exists()
    stale_cluster.record(path, [])
    stale_cluster.forget(path)
    assert not path.exists()


def test_stop_survivors_kills_what_outlives_a_shutdown(sleepers):
    """What the embedded cluster left running after ray.shutdown (connect.py) is killed by
    pid after the wait; what had already exited is not waited for again."""
    done = subprocess.Popen(["true"])
    procs = [psutil.Process(p.pid) for p in sleepers] + [psutil.Process(done.pid)]
    done.wait()
    assert sorted(stale_cluster.stop_survivors(procs, timeout_s=0.5)) == \
        sorted(p.pid for p in sleepers)
    assert all(p.wait(timeout=10) is not None for p in sleepers)
    assert stale_cluster.stop_survivors([], timeout_s=0.5) == []
