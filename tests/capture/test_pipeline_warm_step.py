"""A pipeline stage warms up on two micro-batches (actors/capture/workloads/parallelize/
pipeline.py's ``_warm_step``), not on the schedule's full iteration: the iteration recorded after
it must be the one a full warm-up leaves, op for op, with the same frees at the same places. And
a fake trace does not depend on what its process ran before (actors/capture/fake/free_markers.py's
``op_ends``)."""
from __future__ import annotations

import dataclasses
import gc
import gzip

import orjson
import pytest

from actors.capture import fake_rank
from actors.capture.fake_rank import record_meta_rank
from actors.capture.mesh_world import record_mesh_rank
from actors.capture.request import CaptureRequest
from actors.capture.workloads.config import WorkloadConfig
from actors.capture.workloads.mesh import rank_roles
from actors.gc_pause import gc_paused
from actors.trace.conventions import FREED_OP

WORLD = 12  # pp 3 x dp_shard 2 x tp 2: DTensor's sharding propagation sees the stages' ops
JOB = WorkloadConfig(model="llama", parallel="fsdp2", precision="bf16_mixed", device="fake",
                     vocab=64, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, seq_len=32,
                     batch_size=1,
                     parallelism={"pp": 3, "tp": 2, "pp_microbatches": 3})


def _record(tmp_path, monkeypatch, rank: int, full_warm_up: bool,
            fresh: bool = True) -> tuple[list, bool]:
    """Record ``rank`` (``fresh``: as a process of its own would); ``(its iteration as (op,
    input shapes) and frees, whether the workload had a warm step)``."""
    settle, had = fake_rank.settle, []

    def settle_as_asked(workload):
        had.append(workload.warm_step is not None)
        if full_warm_up:
            workload.warm_step = None
        return settle(workload)

    monkeypatch.setattr(fake_rank, "settle", settle_as_asked)
    if fresh:
        _forget_first_times()
    out = tmp_path / ("full" if full_warm_up else "warm")
    out.mkdir(exist_ok=True)
    with gc_paused():  # as a role's recording runs (mesh_world.record_role): frees in place
        _, path = record_mesh_rank(CaptureRequest(JOB), str(out), rank, WORLD)
    gc.collect()
    return _program(path), had[0]


def _program(path) -> list:
    """The trace's ops as (name, input shapes), its frees as (name, made in the step)."""
    with gzip.open(path) as f:
        nodes = orjson.loads(f.read())["nodes"]
    return [(n["name"], n["inputs"]["values"][1]) if n["name"] == FREED_OP
            else (n["name"], n["inputs"]["shapes"]) for n in nodes]


def _forget_first_times() -> None:
    """Empty the caches whose misses the recorded iteration shows (the fake tensor cache's
    temporaries freed, DTensor's sharding propagation): each recording starts as a process
    of its own would, whatever this process recorded before."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.tensor import DTensor

    FakeTensorMode.cache_clear()
    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.propagate_op_sharding.cache_clear()
    propagator._propagate_tensor_meta_cached.cache_clear()


@pytest.fixture(scope="module")
def stages():
    roles = rank_roles(JOB.parallelism, WORLD)
    return [ranks[0] for ranks in roles.values()]


@pytest.mark.parametrize("stage", [0, 1, 2], ids=["first", "middle", "last"])
def test_a_stage_records_after_its_warm_step_what_a_full_warm_up_leaves(
        tmp_path, monkeypatch, stages, stage):
    warmed, had_warm_step = _record(tmp_path, monkeypatch, stages[stage], full_warm_up=False)
    assert had_warm_step
    full, _ = _record(tmp_path, monkeypatch, stages[stage], full_warm_up=True)
    assert len(warmed) > 1000 and warmed == full
    # the iteration starts by freeing what the last one left: its gradients (set_to_none)
    # and, on the last stage, every micro-batch's logits the schedule kept
    start = next(made for name, made in warmed if name == FREED_OP)
    assert set(start) == {0} and len(start) == 2 + 3 * (stage == 2)


def test_a_trace_does_not_depend_on_what_its_process_recorded_before(tmp_path):
    """The fake tensor cache's misses make temporaries that a hit does not (AdamW's step
    count changes its scalars' keys between the warm-up and the recorded iteration): their
    frees are not written, or the second recording of a rank in one process would differ from
    the first."""
    job = dataclasses.replace(JOB, parallelism={})
    programs = []
    for fresh in (True, False):
        if fresh:
            _forget_first_times()
        out = tmp_path / str(fresh)
        out.mkdir()
        with gc_paused():
            _, path = record_meta_rank(CaptureRequest(job), str(out), 0, 2)
        gc.collect()
        programs.append(_program(path))
    assert programs[0] == programs[1]
