"""Mesh jobs captured on fake (world 4, a tiny Llama): tensor parallel with sequence and loss
parallel, HSDP, context parallel; one recorded rank per role, the other ranks' files derived
with their own process groups, pre-flight's cross-rank check and the meta dry run."""
from __future__ import annotations

import gzip
import json
import textwrap
from collections import Counter

import orjson
import pytest

from actors.capture.workloads.mesh import validate_parallelism
from actors.capture.workloads.config import WorkloadConfig
from actors.errors import ConfigError
from actors.replay.config import AllocationConfig, ReplayConfig
from actors.replay.engine import ReplayEngine
from actors.trace import load_trace
from actors.trace.conventions import trace_file_name
from actors.time_limit import time_limit as real_time_limit
from actors.trace.liveness import compute_liveness
from orchestrator.preflight.validate import preflight
from actors.capture import bound as bound_module
from orchestrator.run.capture import CaptureConfig, run_capture_job

TINY = dict(model="llama", parallel="fsdp2", precision="bf16_mixed", device="fake", vocab=64,
            d_model=64, n_layers=2, n_heads=4, seq_len=32, batch_size=2)


def _capture(out, parallelism, rank0_only=False, **fields):
    cfg = CaptureConfig(workload=WorkloadConfig(**{**TINY, **fields}, parallelism=parallelism),
                        world_size=4, out_dir=str(out))
    return run_capture_job(cfg, rank0_only=rank0_only).meta


@pytest.fixture(scope="module")
def tp_job(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp")
    return out, _capture(out, {"tp": 2})


@pytest.fixture(scope="module")
def cp_job(tmp_path_factory):
    out = tmp_path_factory.mktemp("cp")
    return out, _capture(out, {"cp": 2})


def _dry_run(path) -> dict:
    trace = load_trace(path)
    engine = ReplayEngine(trace, ReplayConfig(mode="compute", device="meta", iters=1,
                                              warmup_iters=1, measure_memory=False,
                                              allocation=AllocationConfig(mode="faithful")))
    try:
        return engine.run().to_dict()
    finally:
        engine.close()


def _groups(path) -> dict[str, str]:
    """``{pg_desc: pg_name}`` of a trace's process-group table."""
    return {g.desc: g.name for g in load_trace(path).process_groups}


def test_tp_ranks_are_one_role_with_their_own_groups(tp_job):
    out, meta = tp_job
    assert meta["mesh"]["roles"] == {"every rank": [0, 1, 2, 3]}
    assert meta["mesh"]["description"] == "dp_shard 2 x tp 2"
    assert [r["rank"] for r in meta["ranks"]] == [0, 1, 2, 3]
    tables = [_groups(out / trace_file_name(r)) for r in range(4)]
    assert tables[0]["mesh_tp"] == tables[1]["mesh_tp"] != tables[2]["mesh_tp"]
    assert tables[0]["mesh_dp_shard"] == tables[2]["mesh_dp_shard"] != tables[1]["mesh_dp_shard"]
    for rank, table in enumerate(tables):
        trace = load_trace(out / trace_file_name(rank))
        used = Counter((op.collective.kind, op.collective.pg_name) for op in trace.collectives
                       if op.collective.kind != "wait")
        # FSDP2's c10d collectives on the shard group (named by the capture), tensor
        # parallel's functional ones on the tp group: nothing left unnamed
        assert {g for _, g in used} == {table["mesh_dp_shard"], table["mesh_tp"]}
        # the root and both blocks in forward, block 0 again in backward (the last block
        # is not resharded after forward, as torchtitan)
        assert used[("all_gather_into_tensor", table["mesh_dp_shard"])] == 4
        assert used[("reduce_scatter_tensor", table["mesh_dp_shard"])] == 3


def test_tp_traces_pass_the_cross_rank_check(tp_job):
    out, _ = tp_job
    result = preflight(out, mode="full", executor="inline")
    assert result.world_size == 4 and result.num_distinct_traces == 4


def test_loss_parallel_and_sequence_parallel_run_on_local_shards(tp_job):
    """DTensor's wrapper ops are replaced by their local work: the cross-entropy runs as
    loss_parallel's local ops on vocabulary-sharded logits (no op sees all 64 columns)."""
    out, _ = tp_job
    trace = load_trace(out / trace_file_name(0))
    names = Counter(op.name for op in trace.ops)
    assert "aten::cross_entropy_loss" not in names and names["aten::amax"] == 1
    # no wrapper op of the whole logits is left (loss_parallel runs none of these locally;
    # DTensor's sharding propagation would run _log_softmax on them under the fake mode)
    assert not {"aten::_log_softmax", "aten::_log_softmax_backward_data",
                "aten::nll_loss_forward"} & set(names)
    first, second = (_dry_run(out / trace_file_name(r)) for r in (0, 1))
    assert first["status"] == "ok" and first["coverage"] == 1.0
    assert first["accounted_peak_bytes"] == second["accounted_peak_bytes"]


def test_cp_ranks_are_roles_and_a_dry_run_needs_one_file_each(cp_job, tmp_path):
    out, meta = cp_job
    assert meta["mesh"]["roles"] == {"cp rank 0": [0, 2], "cp rank 1": [1, 3]}
    ring = [op for op in load_trace(out / trace_file_name(1)).collectives
            if op.collective.pg_name == _groups(out / trace_file_name(1))["mesh_cp"]]
    assert {op.collective.kind for op in ring} >= {"all_gather_into_tensor", "all_to_all_single"}
    peaks = [_dry_run(out / trace_file_name(r))["accounted_peak_bytes"] for r in range(4)]
    assert peaks[0] == peaks[2] and peaks[1] == peaks[3]
    # the two cp ranks run different programs: their traces differ (by their ops; their
    # peaks differ by tens of bytes that also vary from one capture to the next, so two
    # captures' peaks can meet)
    num_ops = [len(load_trace(out / trace_file_name(r)).ops) for r in range(2)]
    assert num_ops[0] != num_ops[1]
    few = _capture(tmp_path / "reps", {"cp": 2}, rank0_only=True)
    assert [r["rank"] for r in few["ranks"]] == [0, 1]
    assert sorted(p.name for p in (tmp_path / "reps").glob("rank-*")) == \
        [trace_file_name(0), trace_file_name(1)]


def test_cp_traces_record_the_frees_of_ring_attention(cp_job):
    """torch's ring attention keeps the all-gathered keys and values (its rotater's buffer)
    until the ring function returns, long after the last kernel reads them: the mesh capture
    writes the run's frees, so the faithful replay holds the buffer that long."""
    out, _ = cp_job
    trace = load_trace(out / trace_file_name(1))
    live = compute_liveness(trace.ops, trace.num_storages)
    freed_at = {suid: end for suid, end, _ in trace.recorded_frees}
    waited = []  # the wait's output of each ring all-gather: the rotater's buffer
    for op in trace.ops:
        if op.name == "_c10d_functional::wait_tensor" and \
                trace.ops[op.index - 1].name == "_c10d_functional::all_gather_into_tensor":
            waited += [t.suid for t in op.output_tensors()]
    assert len(waited) == 2 * TINY["n_layers"]  # one per layer, forward and backward
    assert all(freed_at[s] > live.storage_last[s] for s in waited)


def test_hsdp_all_reduces_across_replicas(tmp_path):
    _capture(tmp_path, {"dp_replicate": 2})
    trace = load_trace(tmp_path / trace_file_name(3))
    groups = _groups(tmp_path / trace_file_name(3))
    kinds = Counter((op.collective.kind, op.collective.pg_name) for op in trace.collectives)
    assert kinds[("all_reduce", groups["mesh_dp_replicate"])] == 3  # one per FSDP unit
    assert kinds[("reduce_scatter_tensor", groups["mesh_dp_shard"])] == 3
    assert _dry_run(tmp_path / trace_file_name(3))["status"] == "ok"


STEP = textwrap.dedent('''
    import torch
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    def build(ctx):
        assert ctx.mesh.mesh_dim_names == ("dp_shard", "tp"), ctx.mesh
        with torch.device(ctx.device):
            model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 16))
        with ctx.parallelizing():
            parallelize_module(model, ctx.mesh["tp"], {"0": ColwiseParallel(),
                                                       "1": RowwiseParallel()})
            fully_shard(model, mesh=ctx.mesh["dp_shard"])
        opt = torch.optim.AdamW(model.parameters())

        def step(batch):
            model(batch).sum().backward()
            opt.step()
            opt.zero_grad()
        return model, lambda: torch.ones(4, 16, device=ctx.device), step
''')


def test_a_custom_step_gets_the_named_mesh(tmp_path):
    (tmp_path / "step.py").write_text(STEP)
    cfg = CaptureConfig(workload=WorkloadConfig(model="custom", device="fake",
                                                entrypoint=str(tmp_path / "step.py") + ":build",
                                                parallelism={"tp": 2}),
                        world_size=4, out_dir=str(tmp_path / "out"))
    meta = run_capture_job(cfg).meta
    assert meta["mesh"]["roles"] == {"every rank": [0, 1, 2, 3]}
    with gzip.open(tmp_path / "out" / trace_file_name(0)) as f:
        names = Counter(n["name"] for n in orjson.loads(f.read())["nodes"])
    assert names["_c10d_functional::all_reduce"] >= 1  # RowwiseParallel's partial sum
    assert json.loads((tmp_path / "out" / "meta.json").read_text())["world_size"] == 4


@pytest.fixture(scope="module")
def pp_job(tmp_path_factory):
    """The job, and the recordings capture_timeout_s bounded (seconds, what)."""
    out = tmp_path_factory.mktemp("pp")
    bounded = []

    def time_limit(seconds, key, what, **stall):
        bounded.append((seconds, what))
        return real_time_limit(seconds, key, what, **stall)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(bound_module, "time_limit", time_limit)
        meta = _capture(out, {"pp": 2}, n_layers=4)
    return out, meta, bounded


def test_pp_stages_are_roles_each_with_its_own_layers(pp_job):
    out, meta, bounded = pp_job
    assert meta["mesh"]["roles"] == {"pp stage 0": [0, 1], "pp stage 1": [2, 3]}
    # each role's recording gets the whole bound (a 3-D 405B job records eight stages)
    assert bounded == [(900.0, "the fake capture's recording of rank 0 (role pp stage 0)"),
                       (900.0, "the fake capture's recording of rank 2 (role pp stage 1)")]
    first, last = (load_trace(out / trace_file_name(r)) for r in (0, 2))
    modules = [{op.module for op in t.ops} for t in (first, last)]
    # each stage keeps the whole model's names: layers 0-1 and the embedding on stage 0,
    # layers 2-3, the norm and the output on stage 1
    assert any("tok_embeddings" in m for m in modules[0])
    assert not any("output" in m or "layers.2" in m for m in modules[0])
    assert any("layers.3" in m for m in modules[1]) and any("output" in m for m in modules[1])
    pp_group = _groups(out / trace_file_name(0))["mesh_pp"]
    p2p = Counter((op.collective.kind, op.collective.pg_name, op.collective.root)
                  for op in first.collectives if op.collective.kind in ("send", "recv"))
    # 1f1b over 2 micro-batches: each activation sent to stage 1 (group rank 1), each
    # gradient received from it
    assert p2p == {("send", pp_group, 1): 2, ("recv", pp_group, 1): 2}
    peaks = [_dry_run(out / trace_file_name(r))["accounted_peak_bytes"] for r in (0, 2)]
    assert all(peaks) and peaks[0] != peaks[1]


def test_pp_x_tp_without_fsdp_keeps_the_last_stages_logits_vocabulary_sharded(tmp_path):
    """pp 2 x tp 2 at world 4: no rank left for FSDP2 (none is applied, as torchtitan), and the
    last stage's cross-entropy runs on vocabulary-sharded logits (loss parallel): no op there
    makes the whole vocabulary's logits, the schedule keeps each micro-batch's shard."""
    vocab = 1000  # a width no other tensor has
    meta = _capture(tmp_path, {"pp": 2, "tp": 2}, n_layers=4, precision="fp32", vocab=vocab)
    assert meta["mesh"]["roles"] == {"pp stage 0": [0, 1], "pp stage 1": [2, 3]}
    last = load_trace(tmp_path / trace_file_name(2))
    kinds = Counter((op.collective.kind, op.collective.source) for op in last.collectives)
    # no FSDP2 (its c10d all-gathers and reduce-scatters): tp's functional ones, the pipeline's
    # p2p
    assert {source for _, source in kinds} == {"functional", "c10d"}
    assert {kind for kind, source in kinds if source == "c10d"} == {"send", "recv"}
    # loss parallel's max, sum of exponentials and target logits, per micro-batch
    assert kinds["all_reduce", "functional"] >= 3 * 2
    widths = {t.shape[-1] for op in last.ops for t in op.output_tensors() if t.shape}
    assert vocab // 2 in widths and vocab not in widths
    assert last.meta["num_wrapper_ops"] > 0  # the DTensor logits' .float() and detach_
    assert _dry_run(tmp_path / trace_file_name(2))["accounted_peak_bytes"] > 0


def test_tp_alone_runs_the_local_step_on_dtensors(tmp_path):
    """tp 2 at world 2, no dp rank: the local step (AdamW on the tp-split DTensors, no gradient
    collective), loss parallel as with FSDP2."""
    cfg = CaptureConfig(workload=WorkloadConfig(**{**TINY, "precision": "fp32"},
                                                parallelism={"tp": 2, "dp_shard": 1}),
                        world_size=2, out_dir=str(tmp_path))
    run_capture_job(cfg, rank0_only=True)
    trace = load_trace(tmp_path / trace_file_name(0))
    assert {op.collective.source for op in trace.collectives} == {"functional"}
    assert any(op.name == "aten::_foreach_mul_" or op.name.startswith("aten::_fused_adamw")
               or op.name == "aten::addcdiv_" for op in trace.ops)  # AdamW on the local shards


def test_preflight_pairs_every_send_with_its_receive(pp_job, tmp_path):
    out, _, _ = pp_job
    assert preflight(out, mode="full", executor="inline").world_size == 4
    broken = tmp_path / "broken"
    broken.mkdir()
    for path in out.glob("*"):
        (broken / path.name).write_bytes(path.read_bytes())
    with gzip.open(broken / trace_file_name(0)) as f:
        doc = orjson.loads(f.read())
    dropped = max(n["id"] for n in doc["nodes"] if n["name"] == "c10d::send")
    doc["nodes"] = [n for n in doc["nodes"] if n["id"] != dropped]
    with gzip.open(broken / trace_file_name(0), "wb") as f:
        f.write(orjson.dumps(doc))
    with pytest.raises(ConfigError, match=r"receive #1 on rank 2 from rank 0 \(node \d+: "
                                          r"\d+ bfloat16\) has no send on rank 0, which sends 1 "
                                          r"to rank 2"):
        preflight(broken, mode="full", executor="inline")


@pytest.mark.parametrize("parallelism, message", [
    ({"pp": 2, "pp_schedule": "interleaved_1f1b"}, "interleaved_1f1b runs 2 or more stages"),
    ({"pp": 4, "pp_stages_per_rank": 2, "pp_schedule": "interleaved_1f1b"},
     r"n_layers=2 blocks \(\+ the embedding and the output\) cannot fill 8 pipeline stages"),
    ({"pp": 2, "pp_microbatches": 1}, r"pp_microbatches=1 < pp=2: 1f1b needs"),
    ({"pp_microbatches": 4, "tp": 2}, "pp_stages_per_rank and pp_microbatches need pp > 1"),
])
def test_pipelines_that_cannot_run_are_refused(parallelism, message):
    with pytest.raises(ConfigError, match=message):
        validate_parallelism(WorkloadConfig(**TINY, parallelism=parallelism),
                             8 if parallelism.get("pp") == 4 else 4)


def test_stages_share_blocks_as_torchtitan():
    from actors.capture.workloads.parallelize.pipeline import stage_layers

    # Llama 3.1 405B over 8 stages: the embedding and the output count one block each
    assert [len(r) for r in stage_layers(126, 8)] == [15, 16, 16, 16, 16, 16, 16, 15]
    assert stage_layers(4, 2) == [range(0, 2), range(2, 4)]
    assert [len(r) for r in stage_layers(2, 4)] == [0, 1, 1, 0]


def test_the_capture_returns_its_roles_and_a_cache_hit_reads_meta_json_once(tmp_path,
                                                                            monkeypatch):
    """A capture's result carries the meta.json it wrote (the mesh's roles with it), so its
    caller reads nothing back; a cached capture's meta.json is read once, for the reuse check
    and the result alike."""
    from orchestrator.studies import study_traces

    wl = WorkloadConfig(**{**TINY, "n_layers": 4}, parallelism={"pp": 2})
    fresh, reused = study_traces.capture_cached(wl, 4, str(tmp_path), "pp", rank0_only=True)
    on_disk = json.loads((fresh.folder / "meta.json").read_text())
    assert not reused and fresh.meta == on_disk and fresh.folder.parent == tmp_path
    assert fresh.roles == on_disk["mesh"]["roles"] and len(fresh.roles) == 2
    reads = []
    real_read = study_traces.read_meta
    monkeypatch.setattr(study_traces, "read_meta", lambda path: reads.append(path) or
                        real_read(path))
    assert study_traces.capture_cached(wl, 4, str(tmp_path), "other", rank0_only=True) == \
        (fresh, True)
    assert reads == [fresh.folder / "meta.json"]
