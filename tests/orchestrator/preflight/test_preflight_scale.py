"""Pre-flight at scale: compact per-rank signatures computed where the traces are (in-process,
a process pool, Ray tasks), ``experiment.preflight_only``, and subsets of a job's ranks replayed
in compute mode through the real run path (archive members shipped by path or object store)."""
from __future__ import annotations

import json
import pickle
import time
from contextlib import contextmanager

import pytest

from actors.errors import ConfigError, TraceError
from actors.replay.config import ReplayConfig
from actors.trace.source import discover
from orchestrator.config import ClusterConfig, ExperimentConfig, RunConfig, TraceConfig
from orchestrator.preflight.signature import rank_signature
from orchestrator.preflight.signature_pool import collect, pick_executor
from orchestrator.preflight.validate import preflight
from scripts.bench_preflight import write_rank_files
from tests.support.bounds import CLUSTER_START_S

LAYERS = 40


@pytest.fixture(scope="module")
def world16(tmp_path_factory):
    folder = tmp_path_factory.mktemp("world16")
    write_rank_files(folder, 16, LAYERS)
    return folder


def test_a_signature_is_a_small_fraction_of_its_trace(tmp_path):
    size = write_rank_files(tmp_path, 2, 400)
    sig = rank_signature(discover(tmp_path)[1], 1, None)
    assert sig.rank == 1 and sig.groups["0"].count == 400 and sig.recorded_world_size == 2
    assert len(pickle.dumps(sig)) < size / 100, (len(pickle.dumps(sig)), size)


def test_executors_agree(world16):
    sources = discover(world16)
    inline = collect(sources, None, "inline")
    pooled = collect(sources, None, "processes", num_workers=2)
    assert inline == pooled and sorted(inline) == list(range(16))
    assert {s.groups["0"].digest for s in inline.values()} == {inline[0].groups["0"].digest}
    with pytest.raises(ValueError, match="executor 'threads'"):
        collect(sources, None, "threads")


def _pool_workers() -> list:
    import psutil

    workers = []
    for child in psutil.Process().children(recursive=True):
        try:
            if "multiprocessing.spawn" in " ".join(child.cmdline()) and child.is_running() \
                    and child.status() != psutil.STATUS_ZOMBIE:
                workers.append(child)
        except psutil.NoSuchProcess:
            pass
    return workers


def test_the_pool_leaves_no_worker_behind(world16):
    """collect() returns with its workers gone, done or late: a refusal right after pre-flight
    exits at once, and a pool left to exit at interpreter shutdown printed "OSError: [Errno 9]
    Bad file descriptor" after the refusal's line (a fresh-clone run's test_cli failure)."""
    sources = discover(world16)
    collect(sources, None, "processes", num_workers=2)
    assert _pool_workers() == []
    with pytest.raises(TraceError, match="took longer than"):
        collect(sources, None, "processes", num_workers=2, timeout_s=1e-3)
    assert _pool_workers() == []


def test_preflight_only_writes_its_result_and_starts_nothing(world16, tmp_path):
    import ray

    from orchestrator.run.launch import run_replay
    from orchestrator.run.sinks import file_sinks

    cfg = RunConfig(trace=TraceConfig(dir=str(world16)),
                    experiment=ExperimentConfig(preflight_only=True))
    summary = run_replay(cfg, tmp_path, sinks=file_sinks())
    assert not ray.is_initialized()  # no cluster, no actor
    written = json.loads((tmp_path / "preflight.json").read_text())
    assert written["world_size"] == written["recorded_world_size"] == 16
    assert written["num_collectives"] == {"0": LAYERS} and written["preflight_warnings"] == []
    assert written["sources"][3].endswith("rank-3.et.json")
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk["status"] == summary["status"] == "ok" and on_disk["timings_s"]["preflight_s"] > 0
    assert not (tmp_path / "ranks.csv").exists()


# ---------------------------------------------------------------- on a Ray cluster



@pytest.mark.slow
def test_ray_tasks_reduce_the_traces(ray_session, world16, tmp_path):
    assert preflight(world16, executor="ray").num_collectives == {"0": LAYERS}
    big = tmp_path / "big"
    write_rank_files(big, 40, 800)  # > 8 MiB on disk: too much for in-process reduction
    assert pick_executor(discover(big)) == "ray"
    with every_cpu_held():  # Ray tasks would wait for a CPU forever: the pool reduces them
        assert pick_executor(discover(big)) == "processes"
        assert preflight(big).num_collectives == {"0": 800}
    (big / "rank-7.et.json").write_text('{"schema": "1.1.1-chakra.0.0.4", "nodes": [')
    with pytest.raises(TraceError, match="rank-7.et.json: truncated JSON"):
        preflight(big)


@contextmanager
def every_cpu_held():
    """One actor holds every CPU of the cluster (as a sweep's kept actor group does between
    points) for the body."""
    import ray

    holder = ray.remote(num_cpus=ray.cluster_resources()["CPU"])(_Holder).remote()
    try:
        ray.get(holder.ready.remote(), timeout=60)
        deadline = time.monotonic() + 10  # the resource view lags the placement a little
        while ray.available_resources().get("CPU", 0) >= 1:
            assert time.monotonic() < deadline, "the actor's CPUs never showed as taken"
            time.sleep(0.2)
        yield
    finally:
        ray.kill(holder)


class _Holder:
    def ready(self) -> bool:
        return True


def _cfg(trace_dir, **trace) -> RunConfig:
    return RunConfig(cluster=ClusterConfig(timeout_s=CLUSTER_START_S, num_cpus=4),
                     trace=TraceConfig(dir=str(trace_dir), **trace),
                     replay=ReplayConfig(mode="compute", device="meta", iters=1, warmup_iters=0),
                     experiment=ExperimentConfig(replay_timeout_s=180, failure_grace_s=3))


@pytest.mark.slow
@pytest.mark.parametrize("transfer", ["path", "object_store"])
def test_two_ranks_of_the_dlrm_archive_replay_in_compute_mode(ray_session, public_trace_dir,
                                                              tmp_path, transfer):
    from orchestrator.run.launch import run_replay
    from orchestrator.run.sinks import file_sinks

    archive = public_trace_dir / "dlrm_pytorch_et.tar.gz"
    summary = run_replay(_cfg(archive, ranks=[0, 3], transfer=transfer), tmp_path,
                         sinks=file_sinks())
    assert summary["status"] == "ok", summary["error"]
    assert summary["world_size"] == 2 and summary["trace_ranks"] == [0, 3]
    assert summary["preflight_warnings"] == []
    cfg = _cfg(archive, ranks=[0, 3])
    cfg.replay.mode, cfg.replay.device = "full", "cpu"
    with pytest.raises(ConfigError, match=r"missing trace files for rank\(s\) \[1, 2, 4, 5, 6, 7\]"):
        run_replay(cfg, tmp_path / "full")


@pytest.mark.slow
def test_one_file_of_a_two_gpu_job_replays_in_compute_mode(ray_session, public_trace_dir, tmp_path):
    from orchestrator.run.launch import run_replay
    from orchestrator.run.sinks import file_sinks

    summary = run_replay(_cfg(public_trace_dir / "resnet_2gpu_et.json.gz"), tmp_path,
                         sinks=file_sinks())
    assert summary["status"] == "ok", summary["error"]
    assert summary["world_size"] == 1 and summary["trace_ranks"] == [0]
