"""ZeRO-3 partitions every model state, not only parameters: on a tiny Llama traced on meta
(AdamW, bf16), gradients are reduce-scattered to 1/N shards, AdamW's two states live as 1/N
shards and the step's temporaries are shard-sized, so the accounted memory shrinks with N by
exactly what the model's parameter sizes say; the step really runs on shards (cpu); in a
data-parallel trace a gradient is reduced after its bucket's copy_."""
from __future__ import annotations

import pytest
import torch

from actors.replay.config import AllocationConfig, ReplayConfig
from actors.replay.engine import ReplayEngine
from actors.replay.memory.tensor_store import FLOAT_FILL
from actors.trace import load_trace
from actors.zero3.config import Zero3Config
from actors.zero3.extension import zero3_extensions
from actors.zero3.states_plan import GRAD, STATE, TEMP
from actors.zero3.partition import shard_numel
from orchestrator.studies import study_traces
from tests.orchestrator.studies.test_oom_study import TINY_LLAMA

BF16 = 2  # bytes per element: the tiny Llama is traced in bfloat16
BUCKET = 1000  # elements: several reduce-scatters per step on the tiny model


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """The tiny Llama's trace (local: no collectives) and its parameters' element counts."""
    folder = study_traces.cached_capture("llama_8b", TINY_LLAMA, 1,
                                         str(tmp_path_factory.mktemp("cache")))
    model, _ = study_traces.traced_model(folder)
    return load_trace(folder / "rank-0.et.json.gz"), [p.numel() for p in model.parameters()]


def shards(numels: list[int], world: int) -> int:
    """Bytes of one bf16 1/world shard of every parameter (DeepSpeed's padding)."""
    return BF16 * sum(shard_numel(n, world) for n in numels)


def replay(trace, world: int, mode: str = "lazy", device: str = "meta", iters: int = 1):
    [ext] = zero3_extensions(Zero3Config(strategy="per_module", world_size=world,
                                         param_persistence_threshold=0,
                                         reduce_bucket_size=BUCKET, layout="trace"), trace)
    engine = ReplayEngine(trace, ReplayConfig(
        mode="compute", device=device, iters=iters, warmup_iters=0, measure_memory=False,
        allocation=AllocationConfig(mode=mode)), extensions=[ext])
    return engine, ext


def zero3_bytes(engine) -> int:
    """Bytes the extension has charged: held bytes minus the storages the engine accounts."""
    return engine.memory.held_bytes - sum(engine.memory.held)


def test_adamw_states_are_found_per_parameter(llama):
    trace, numels = llama
    _, ext = replay(trace, 4)
    kinds = {k: ext.states.of_kind(k) for k in (GRAD, STATE, TEMP)}
    # single-tensor AdamW: a gradient, exp_avg and exp_avg_sq, and two temporaries
    # (sqrt(exp_avg_sq), then its division by the bias correction) per parameter
    assert [len(kinds[k]) for k in (GRAD, STATE, TEMP)] == [len(numels), 2 * len(numels),
                                                            2 * len(numels)]
    for kind in (GRAD, STATE, TEMP):
        assert sorted(m.numel for m in kinds[kind]) == \
            sorted(numels * (1 if kind == GRAD else 2))
        assert all(m.numel == m.param.numel for m in kinds[kind])
    assert all(b.numel <= BUCKET or len(b.grads) == 1 for b in ext.states.buckets)


@pytest.mark.parametrize("world", [2, 8])
def test_the_step_starts_with_one_shard_of_every_model_state(llama, world):
    """After the last reduce-scatter the rank holds 1/world of the parameters, the gradients
    and both AdamW states: four shards, no full gradient."""
    trace, numels = llama
    engine, ext = replay(trace, world)
    srt = ext.states_runtime
    after = []
    reduce_scatter = srt.reduce_scatter

    def recording(bucket):
        reduce_scatter(bucket)
        after.append((bucket.at, zero3_bytes(engine), srt.metrics.grad_full_bytes))
    srt.reduce_scatter = recording
    report = engine.run().to_dict()
    assert report["status"] == "ok", report["error"]
    _, charged, full = max(after)
    assert (charged, full) == (4 * shards(numels, world), 0)
    z = report["zero3"]
    assert z["shard_bytes"] == z["grad_shard_bytes"] == shards(numels, world)
    assert z["optimizer_state_bytes"] == 2 * shards(numels, world)
    assert z["num_reduce_scatters_per_iteration"] == len(ext.states.buckets) > 1
    # full gradients wait only in their bucket (one gradient, or at most BUCKET elements),
    # beside the one backward is making (the one that overflows it sends it)
    largest = max(m.nbytes for m in ext.states.of_kind(GRAD))
    assert 0 < z["grad_full_peak_bytes"] <= max(BF16 * BUCKET, largest) + largest


def test_lazy_peak_shrinks_with_the_world_by_the_model_state_shards(llama):
    """The peak (in backward) holds parameter and AdamW-state shards: doubling the world
    takes exactly three shards' difference off it. Full-size optimizer state would not shrink,
    and full gradients held to the step would put the peak there, above all of this."""
    trace, numels = llama
    peaks = {w: replay(trace, w)[0].run().to_dict()["accounted_peak_bytes"] for w in (2, 4, 8)}
    for small, large in ((2, 4), (4, 8)):
        assert peaks[small] - peaks[large] == 3 * (shards(numels, small) - shards(numels, large))
    assert peaks[8] < 2 * BF16 * sum(numels)  # below full gradients plus full parameters


def test_faithful_keeps_shards_of_parameters_and_optimizer_state_between_iterations(llama):
    trace, numels = llama
    engine, ext = replay(trace, 4, mode="faithful", iters=2)
    report = engine.run().to_dict()
    assert report["status"] == "ok", report["error"]
    owned = {m.suid for m in ext.states.states}
    assert not engine.policy.persistent & owned  # the policy keeps inputs, not model state
    assert zero3_bytes(engine) == 3 * shards(numels, 4)  # parameters, exp_avg, exp_avg_sq
    assert engine.memory.held_bytes == report["persistent_bytes"] + 3 * shards(numels, 4)


def test_the_step_runs_on_shards_on_cpu(llama):
    """On cpu every op of the step runs on flat shards (no mismatch counted, nothing
    materialized full-size), and its in-place updates land in the shards."""
    trace, numels = llama
    engine, ext = replay(trace, 4, device="cpu", iters=2)
    owned = ext.owned_storages()
    materialized = []
    materialize = engine.store.materialize
    engine.store.materialize = lambda t: (materialized.append(t) if t.suid in owned else None,
                                          materialize(t))[1]
    report = engine.run().to_dict()
    assert report["status"] == "ok", report["error"]
    assert report["coverage"] == 1.0 and report["num_shape_mismatches"] == 0
    assert not materialized
    for shard in list(ext.runtime.shards.values()) + list(ext.states_runtime.state_shards.values()):
        assert shard.numel() in {shard_numel(n, 4) for n in numels}
        assert not torch.all(shard == FLOAT_FILL)  # AdamW wrote into it


def test_data_parallel_gradients_are_reduced_after_their_bucket_copy(tmp_path):
    """A data-parallel trace's gradient is final after its DDP bucket's copy_ (or, alone in its
    bucket, its all-reduce): only then is it reduce-scattered."""
    folder = study_traces.cached_capture(
        "llama_8b", dict(TINY_LLAMA, kind="llama_dp", dp_bucket_numel=3000), 2, str(tmp_path))
    trace = load_trace(folder / "rank-0.et.json.gz")
    engine, ext = replay(trace, 4)
    grads = ext.states.of_kind(GRAD)
    ready = {trace.ops[g.ready].name for g in grads}
    assert ready == {"aten::copy_", "c10d::allreduce_"}
    assert any(trace.ops[g.ready].name == "aten::copy_" for g in grads)
    report = engine.run().to_dict()
    assert report["status"] == "ok", report["error"]
    assert report["zero3"]["grad_shard_bytes"] == BF16 * sum(
        shard_numel(g.numel, 4) for g in grads)
