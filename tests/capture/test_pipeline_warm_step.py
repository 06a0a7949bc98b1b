"""A middle pipeline stage warms up on two micro-batches (actors/capture/workloads/parallelize/
pipeline.py's ``_warm_step``), not on the schedule's full iteration: the iteration recorded after
it must be the one a full warm-up leaves, op for op, with the same frees at the same places."""
from __future__ import annotations

import gc
import gzip

import orjson
import pytest

from actors.capture import fake_rank
from actors.capture.mesh_world import record_mesh_rank
from actors.capture.request import CaptureRequest
from actors.capture.workloads.config import WorkloadConfig
from actors.capture.workloads.mesh import rank_roles
from actors.gc_pause import gc_paused
from actors.trace.conventions import FREED_OP

WORLD = 16  # pp 4 x dp_shard 2 x tp 2: DTensor's sharding propagation sees the stages' ops
JOB = WorkloadConfig(model="llama", parallel="fsdp2", precision="bf16_mixed", device="fake",
                     vocab=64, d_model=64, n_layers=6, n_heads=4, n_kv_heads=2, seq_len=32,
                     batch_size=1, activation_checkpointing="full",
                     parallelism={"pp": 4, "tp": 2, "pp_microbatches": 4})


def _record(tmp_path, monkeypatch, rank: int, full_warm_up: bool) -> tuple[list, bool]:
    """Record ``rank``; ``(its iteration as (op, input shapes) and frees, whether the
    workload had a warm step)``."""
    settle, had = fake_rank.settle, []

    def settle_as_asked(workload):
        had.append(workload.warm_step is not None)
        if full_warm_up:
            workload.warm_step = None
        return settle(workload)

    monkeypatch.setattr(fake_rank, "settle", settle_as_asked)
    _forget_first_times()
    out = tmp_path / ("full" if full_warm_up else "warm")
    out.mkdir(exist_ok=True)
    with gc_paused():  # as a role's recording runs (mesh_world.record_role): frees in place
        _, path = record_mesh_rank(CaptureRequest(JOB), str(out), rank, WORLD)
    gc.collect()
    with gzip.open(path) as f:
        nodes = orjson.loads(f.read())["nodes"]
    program = [(n["name"], n["inputs"]["values"][1]) if n["name"] == FREED_OP
               else (n["name"], n["inputs"]["shapes"]) for n in nodes]
    return program, had[0]


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


def test_a_middle_stage_records_after_its_warm_step_what_a_full_warm_up_leaves(
        tmp_path, monkeypatch, stages):
    middle = stages[1]
    warmed, had_warm_step = _record(tmp_path, monkeypatch, middle, full_warm_up=False)
    assert had_warm_step
    full, _ = _record(tmp_path, monkeypatch, middle, full_warm_up=True)
    assert len(warmed) > 1000 and warmed == full
    # the iteration starts by freeing the gradients the last one left (set_to_none)
    assert any(name == FREED_OP and set(made) == {0} for name, made in warmed[:10])


def test_the_first_and_the_last_stage_warm_up_in_full(tmp_path, monkeypatch, stages):
    for rank in (stages[0], stages[-1]):
        assert not _record(tmp_path, monkeypatch, rank, full_warm_up=False)[1]

