"""ZeRO-3 inside the replay engine: every strategy replays a captured fine-grained model with
its parameters partitioned, releases give the memory back (only shards stay), and an emulated
64-rank job on meta holds 1/64 of every parameter."""
from __future__ import annotations

import pytest

from actors.trace.conventions import trace_file_name
from actors.replay.config import AllocationConfig, ReplayConfig
from actors.replay.engine import ReplayEngine
from actors.trace import load_trace
from actors.trace.liveness import compute_liveness
from actors.capture.finegrained_capture import capture_data_parallel
from actors.capture.workloads import finegrained_model as fg
from actors.zero3.config import Zero3Config
from actors.zero3.extension import Zero3Extension
from actors.zero3.markers import read_backward_marks
from actors.zero3.partition import aligned_numel
from orchestrator.config import DEMO_TRACES

MODEL = fg.FineGrainedConfig(d_model=16, num_blocks=2, linears_per_block=3, num_experts=8,
                             expert_hidden=8, batch_size=4)
STRATEGIES = ["per_param", "per_module", "leaf_coalesced", "bucketed"]


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    out = capture_data_parallel(tmp_path_factory.mktemp("finegrained"), 2, MODEL)
    return load_trace(out / trace_file_name(0))


def replay(trace, device="cpu", iters=2, **zero3):
    zero3.setdefault("param_persistence_threshold", 0)
    zero3.setdefault("layout", "trace")  # the partitioning alone (DeepSpeed's buffers: test_zero3_deepspeed_layout.py)
    ext = Zero3Extension(Zero3Config(**zero3), read_backward_marks(trace))
    engine = ReplayEngine(trace, ReplayConfig(mode="compute", device=device, iters=iters,
                                              warmup_iters=0, measure_memory=False),
                          extensions=[ext])
    return engine, ext


def zero3_bytes(engine) -> int:
    """Bytes the extension has charged: held bytes minus the storages the engine accounts."""
    return engine.memory.held_bytes - sum(engine.memory.held)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_release_gives_back_everything_but_the_shards(trace, strategy):
    engine, ext = replay(trace, strategy=strategy, world_size=2, leaf_modules=fg.LEAF_PATTERNS,
                         prefetch_bucket_size=2000)
    rt = ext.runtime
    param_uids = {p.suid: engine.liveness.uids_by_suid[p.suid] for p in ext.z.params}
    release = rt.release

    def checked_release(home):
        release(home)
        for p in home.params:  # no view of a released parameter survives in the store
            assert all(engine.store.tensors[u] is None for u in param_uids[p.suid])
        m = rt.metrics
        assert zero3_bytes(engine) == m.shard_bytes + m.gathered_bytes + m.scratch_bytes \
            + m.optimizer_state_bytes + m.grad_full_bytes + m.grad_shard_bytes
        # views ops make of a parameter (aten::t of a weight) are not accounted a second time
        assert not any(engine.memory.held[p.suid] for p in ext.z.params)
    rt.release = checked_release
    materialized, materialize = [], engine.store.materialize
    engine.store.materialize = lambda t: (materialized.append(t) if t.suid in param_uids
                                          else None, materialize(t))[1]
    report = engine.run().to_dict()
    assert report["status"] == "ok", report["error"]
    assert report["coverage"] == 1.0 and report["num_shape_mismatches"] == 0
    figures = ext.report()
    assert figures["num_allgathers_per_iteration"] > 0 and figures["gathered_peak_bytes"] > 0
    assert not rt.inflight and not rt.held
    assert rt.metrics.gathered_bytes == rt.metrics.scratch_bytes == 0
    assert not ext.states_runtime.held  # gradient shards and update temporaries released
    shards = sum(4 * aligned_numel(p.numel, 2) // 2 for p in ext.z.params)
    assert figures["shard_bytes"] == shards
    assert zero3_bytes(engine) == shards + figures["optimizer_state_bytes"] == 3 * shards
    assert not materialized  # every use found its parameter gathered or bound


def test_world_size_64_on_meta_holds_one_64th(trace):
    engine, ext = replay(trace, device="meta", strategy="leaf_coalesced", world_size=64,
                         leaf_modules=fg.LEAF_PATTERNS)
    report = engine.run().to_dict()
    assert report["status"] == "ok", report["error"]
    figures = ext.report()
    assert figures["world_size"] == 64 and figures["emulated"]
    numels = [p.numel for p in ext.z.params]
    assert figures["shard_bytes"] == 4 * sum(aligned_numel(n, 64) for n in numels) // 64
    assert figures["shard_bytes"] * 16 < 4 * sum(numels)  # far below the full parameters
    # every all-gather produced the whole unit: 64 shards' worth
    assert figures["allgather_bytes_per_iteration"] == \
        4 * sum(g.numel for g in ext.z.plan.gathers)
    assert all(g.numel % 64 == 0 for g in ext.z.plan.gathers)


DEMO = DEMO_TRACES / "gpt_dp_4"


def test_measured_peak_includes_the_shards():
    """On cpu every accounted storage is really allocated, so the measured peak is at least
    the accounted one: shards and optimizer state are allocated inside the meter's window.
    The engines run one after the other in one process, as a sweep's points do in one actor:
    the previous engine's garbage must not count as negative bytes."""
    trace = load_trace(DEMO / "rank-0.et.json.gz")
    for strategy, mode in [("per_param", "faithful"), ("per_param", "lazy"),
                           ("per_param", "pre_allocate"), ("leaf_coalesced", "faithful")]:
        ext = Zero3Extension(Zero3Config(strategy=strategy, param_persistence_threshold=0),
                             read_backward_marks(trace))
        cfg = ReplayConfig(mode="compute", device="cpu", iters=1, warmup_iters=0,
                           allocation=AllocationConfig(mode=mode))
        report = ReplayEngine(trace, cfg, extensions=[ext]).run().to_dict()
        assert report["status"] == "ok", report["error"]
        assert report["memory_measure_method"] is not None
        assert ext.report()["shard_bytes"] > 0
        assert report["measured_peak_bytes"] >= report["accounted_peak_bytes"], \
            (strategy, mode)


@pytest.mark.parametrize("strategy,world", [("none", None), ("per_param", None),
                                            ("per_param", 64), ("leaf_coalesced", 4),
                                            ("per_module", 2), ("bucketed", 64)])
def test_lower_bound_never_exceeds_the_lazy_peak(strategy, world):
    """The liveness lower bound is on what the replay holds: under ZeRO-3 the parameters and
    model states count as the shards the emulation keeps, not the trace's full tensors."""
    trace = load_trace(DEMO / "rank-0.et.json.gz")
    cfg = Zero3Config(strategy=strategy, param_persistence_threshold=0, world_size=world,
                      layout="trace")  # the shards alone (DeepSpeed's buckets would dominate)
    exts = [Zero3Extension(cfg, read_backward_marks(trace))] if cfg.enabled else []
    replay_cfg = ReplayConfig(mode="compute", device="meta", iters=1, warmup_iters=0,
                              allocation=AllocationConfig(mode="lazy"))
    report = ReplayEngine(trace, replay_cfg, extensions=exts).run().to_dict()
    assert report["status"] == "ok", report["error"]
    bound, peak = report["liveness_lower_bound_bytes"], report["accounted_peak_bytes"]
    assert 0 < bound <= peak
    if world == 64:  # 1/64 of the parameters and optimizer state: far below the trace's bound
        assert bound < compute_liveness(trace.ops, trace.num_storages).lower_bound_bytes
