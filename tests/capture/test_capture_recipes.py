"""Capture recipes (docs/capture.md, "Recipes"): FSDP2 with bf16 mixed precision, activation
checkpointing modes, gradient accumulation, the fp32 loss, fused attention on meta, and the old
``kind`` / ``dtype`` names. Multi-rank captures run as 2 gloo processes (no Ray); single-rank
ones in this process, over torch's fake process group where a collective must be recorded."""
from __future__ import annotations

import gzip
import json
from collections import Counter
from pathlib import Path

import orjson
import pytest
import torch
import torch.distributed as dist

from actors.trace.conventions import trace_file_name
from actors.capture.recorder import record_iteration
from actors.capture.worker import warm_up
from actors.capture.workloads.build import WorkloadConfig, build_model, build_workload
from actors.errors import ConfigError
from actors.trace import compute_liveness, load_trace
from orchestrator.config import REPO_ROOT
from tests.capture.test_capture_meta import meta_capture
from tests.support.trace_factory import run_rank_script

LLAMA = dict(model="llama", vocab=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64,
             seq_len=16, batch_size=2)
LINEARS_PER_BLOCK = 7  # wq, wk, wv, wo, w1, w3, w2 in call order

# One rank of a capture through the real per-rank procedure (actors/capture/worker.py).
_RANK_SCRIPT = r'''
import json, os, sys
rank, world, port, out = sys.argv[1:5]
os.environ.update(RANK=rank, WORLD_SIZE=world, MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                  LOCAL_RANK=rank)
from actors.capture.request import CaptureRequest
from actors.capture.worker import run_capture
run_capture(CaptureRequest.from_dict(json.loads(os.environ["RECIPE_CAPTURE_CFG"])), out)
os._exit(0)  # torch sometimes aborts in static destructors after gloo + ET (trace_factory)
'''


def _capture_two_ranks(out_dir: Path, monkeypatch, **workload) -> Path:
    cfg = {"workload": workload, "warmup_iters": 1, "timing_iters": 1, "record_kineto": False,
           "dist_timeout_s": 60}
    monkeypatch.setenv("RECIPE_CAPTURE_CFG", json.dumps(cfg))
    monkeypatch.setenv("PYTHONPATH", str(REPO_ROOT))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(out_dir / "torch_extensions"))
    return run_rank_script(_RANK_SCRIPT, out_dir, 2, f"capture of {workload}", timeout_s=240)


def _record_here(path: Path, world_size: int = 1, **workload):
    """Record one iteration in this process (world_size > 1: over the fake process group);
    ``(trace, workload)``."""
    cfg = WorkloadConfig(**{"parallel": "local", **workload})
    if world_size > 1:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        wl = build_workload(cfg, 0, world_size)
        warm_up(wl, 1)
        record_iteration(wl.step, wl.next_batch(), wl.model, 1, str(path))
    finally:
        if world_size > 1:
            dist.destroy_process_group()
    return load_trace(path), wl


def _raw_nodes(path: Path) -> list[dict]:
    return sorted(orjson.loads(gzip.decompress(path.read_bytes()))["nodes"],
                  key=lambda n: n["id"])


def _shapes_dtypes(tensors) -> list[tuple]:
    return [(tuple(t.shape), str(t.dtype)) for t in tensors]


# --- FSDP2, bf16 mixed precision, gradient accumulation (2 gloo ranks) ---------------------

@pytest.fixture(scope="module")
def fsdp2_capture(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp2_bf16_mixed")
    with pytest.MonkeyPatch.context() as mp:
        _capture_two_ranks(out, mp, **LLAMA, parallel="fsdp2", precision="bf16_mixed",
                           grad_accum_steps=2)
    return out


def test_fsdp2_bf16_mixed_gathers_bf16_and_steps_fp32_shards(fsdp2_capture):
    """Parameters are all-gathered in bf16 (FSDP2's copy-in buffer and the collective), gradients
    reduce-scattered in fp32, and AdamW updates the fp32 shards: half of each parameter."""
    params = list(build_model(WorkloadConfig(**LLAMA))[0].parameters())
    for rank in range(2):
        path = fsdp2_capture / trace_file_name(rank)
        trace = load_trace(path)
        gathers = [op for op in trace.collectives
                   if op.collective.kind == "all_gather_into_tensor"]
        scatters = [op for op in trace.collectives if op.collective.kind == "reduce_scatter_tensor"]
        assert gathers and {op.collective.dtype for op in gathers} == {"bfloat16"}
        assert scatters and {op.collective.dtype for op in scatters} == {"float32"}
        copy_ins = [op for op in trace.ops if op.name == "fsdp::all_gather_copy_in"]
        assert len(copy_ins) == len(gathers)
        assert all({d for _, d in _shapes_dtypes(op.output_tensors())} == {"bfloat16"}
                   for op in copy_ins)
        # Every gathered element once per rank, every shard once: all elements, in bf16.
        assert sum(op.collective.out_nelems for op in gathers[:1 + LLAMA["n_layers"]]) == \
            sum(p.numel() for p in params)
        # The trace's top-level optimizer ops are DTensor calls; the shard-local op runs
        # inside each (under a PythonSubclass frame): fp32, half of each parameter.
        nodes = _raw_nodes(path)
        by_id = {n["id"]: n for n in nodes}
        local = [n for n in nodes if n["name"] == "aten::addcdiv_"
                 and by_id[n["ctrl_deps"]]["name"] == "PythonSubclass"]
        assert len(local) == len(params)
        assert sorted(n["inputs"]["values"][0][3] for n in local) == \
            sorted(p.numel() // 2 for p in params)
        assert {n["inputs"]["types"][0] for n in local} == {"Tensor(float)"}


def test_fsdp2_grad_accum_reduces_once_after_two_forwards(fsdp2_capture):
    """grad_accum_steps=2: two forwards and backwards, one reduce-scatter per FSDP unit (the
    blocks and the root) after the last; each micro-batch gathers the root once and every
    block in forward and again in backward, but the last block (kept gathered: backward
    starts with it)."""
    trace = load_trace(fsdp2_capture / trace_file_name(0))
    counts = Counter(op.name for op in trace.ops)
    n_layers = LLAMA["n_layers"]
    assert counts["aten::embedding"] == 2 and counts["aten::cross_entropy_loss"] == 2
    kinds = Counter(op.collective.kind for op in trace.collectives)
    assert kinds["reduce_scatter_tensor"] == n_layers + 1
    assert kinds["all_gather_into_tensor"] == 2 * (1 + n_layers + n_layers - 1)
    # The reduce-scatters follow the second micro-batch's loss.
    second_loss = [i for i, op in enumerate(trace.ops) if op.name == "aten::cross_entropy_loss"][1]
    assert all(op.index > second_loss for op in trace.collectives
               if op.collective.kind == "reduce_scatter_tensor")


# --- DDP with autocast and gradient accumulation (fake process group, this process) -----------

def test_ddp_grad_accum_all_reduces_once_in_fp32_under_autocast(tmp_path):
    trace, wl = _record_here(tmp_path / "ddp.et.json.gz", world_size=2, **LLAMA, parallel="ddp",
                             precision="bf16_mixed", grad_accum_steps=2, dp_bucket_numel=3000)
    params = list(wl.model.parameters())
    assert {p.dtype for p in params} == {torch.float32}  # master weights
    counts = Counter(op.name for op in trace.ops)
    assert counts["aten::embedding"] == 2 and counts["aten::cross_entropy_loss"] == 2
    # One all-reduce per bucket, after the second backward: every gradient element once, fp32.
    sigs = [op.collective.signature() for op in trace.collectives]
    assert {(s[0], s[3]) for s in sigs} == {("all_reduce", "float32")}
    assert sum(s[1] for s in sigs) == sum(p.numel() for p in params)
    last_loss = max(i for i, op in enumerate(trace.ops) if op.name == "aten::cross_entropy_loss")
    assert min(op.index for op in trace.collectives) > last_loss
    # Autocast: the block matmuls run in bf16 on bf16 casts of the fp32 weights.
    linears = [op for op in trace.ops if op.name == "aten::linear"]
    assert linears and all(_shapes_dtypes(op.output_tensors())[0][1] == "bfloat16"
                           for op in linears)


# --- activation checkpointing (local, this process) ----------------------------------------

def _linear_calls(trace) -> list[tuple[str, int]]:
    """(module range, output storage id) of every aten::linear, in execution order."""
    return [(op.module, op.output_tensors()[0].storage_id) for op in trace.ops
            if op.name == "aten::linear"]


@pytest.fixture(scope="module")
def ac_traces(tmp_path_factory):
    out = tmp_path_factory.mktemp("ac")
    return {mode: _record_here(out / f"{mode}.et.json.gz", **LLAMA,
                               activation_checkpointing=mode)[0]
            for mode in ("none", "full", "selective_layer", "selective_op")}


def test_full_ac_recomputes_every_block_forward_in_backward(ac_traces):
    counts = {m: Counter(op.name for op in t.ops) for m, t in ac_traces.items()}
    n_layers = LLAMA["n_layers"]
    assert counts["none"]["aten::linear"] == LINEARS_PER_BLOCK * n_layers + 1  # + output head
    assert counts["full"]["aten::linear"] == \
        counts["none"]["aten::linear"] + LINEARS_PER_BLOCK * n_layers
    assert counts["full"]["aten::_scaled_dot_product_flash_attention_for_cpu"] == 2 * n_layers
    # selective_layer, ac_every=2: only the second block is recomputed.
    assert counts["selective_layer"]["aten::linear"] == \
        counts["none"]["aten::linear"] + LINEARS_PER_BLOCK
    recomputed = Counter(module for module, _ in _linear_calls(ac_traces["selective_layer"]))
    assert {m.split(".")[0] + "." + m.split(".")[1] for m, c in recomputed.items() if c == 2} == \
        {"## module:layers.1"}


def test_selective_op_ac_keeps_every_other_matmul(ac_traces, tmp_path):
    """In each block's recompute, a matmul whose output was kept returns the forward's tensor
    (same storage); the others run again. torchtitan's pattern: the 1st, 3rd, 5th and 7th
    matmul of a block are kept, the 2nd, 4th and 6th recomputed; full AC recomputes all 7.
    Recorded on meta, where no address is ever handed out twice: on cpu a recomputed output
    can land on the storage its freed forward twin had and look kept."""
    traces = {}
    for mode in ("selective_op", "full"):
        meta_capture(tmp_path / mode, 1, **{k: v for k, v in LLAMA.items() if k != "model"},
                     kind="llama_local",
                     activation_checkpointing=mode)
        traces[mode] = load_trace(tmp_path / mode / trace_file_name(0))

    def recompute_kept(mode):
        first, kept = {}, {}
        for module, storage in _linear_calls(traces[mode]):
            if module in first:  # the second call of a block's Linear: its recompute
                block = module.split(".")[1]
                kept.setdefault(block, []).append(storage == first[module])
            else:
                first[module] = storage
        return kept

    pattern = [True, False, True, False, True, False, True]
    assert recompute_kept("selective_op") == {str(i): pattern for i in range(LLAMA["n_layers"])}
    assert recompute_kept("full") == {str(i): [False] * 7 for i in range(LLAMA["n_layers"])}
    # The dispatch mode's frame is transparent: ops keep their module range.
    trace = ac_traces["selective_op"]
    assert not any(op.module == "PythonDispatchMode" for op in trace.ops)


def test_meta_liveness_counts_what_each_mode_keeps(tmp_path):
    """On meta (addresses never reused) a kept matmul output stays one storage generation from
    forward to its recompute, so the trace's liveness bound orders the modes as their memory:
    full keeps least, selective_op and selective_layer more (the kept matmul and attention
    outputs; every block but the checkpointed 2nd and 4th), none most. Four blocks: with two,
    the recompute of the checkpointed last block, under all of the first's activations, is
    the peak of both selective_layer and none. On cpu, where addresses are reused, these
    bounds vary by a few KiB from run to run."""
    shape = dict(LLAMA, kind="llama_local", vocab=32, d_model=64, ffn_dim=256, seq_len=64,
                 n_layers=4)
    bounds = {}
    for mode in ("none", "selective_op", "selective_layer", "full"):
        meta_capture(tmp_path / mode, 1, **shape, activation_checkpointing=mode)
        trace = load_trace(tmp_path / mode / trace_file_name(0))
        bounds[mode] = compute_liveness(trace.ops, trace.num_storages).lower_bound_bytes
    assert bounds["full"] < bounds["selective_op"] < bounds["none"]
    assert bounds["full"] < bounds["selective_layer"] < bounds["none"]


def test_gpt_selective_op_ac_runs(tmp_path):
    """GPT's biased Linears run addmm: counted as matmuls, so the pattern holds there too."""
    trace, _ = _record_here(tmp_path / "gpt.et.json.gz", model="gpt", vocab=64, d_model=32,
                            n_layers=1, n_heads=2, seq_len=16, batch_size=2,
                            activation_checkpointing="selective_op")
    counts = Counter(op.name for op in trace.ops)
    assert counts["aten::linear"] == 2 * 4 + 1  # qkv, proj, fc, proj twice; the head once


# --- precision ------------------------------------------------------------------------------

def test_loss_runs_on_fp32_logits(tmp_path):
    trace, _ = _record_here(tmp_path / "bf16.et.json.gz", **LLAMA, precision="bf16")
    i = next(i for i, op in enumerate(trace.ops) if op.name == "aten::cross_entropy_loss")
    assert _shapes_dtypes(trace.ops[i].input_tensors())[0] == \
        ((LLAMA["batch_size"] * LLAMA["seq_len"], LLAMA["vocab"]), "float32")
    logits = (LLAMA["batch_size"], LLAMA["seq_len"], LLAMA["vocab"])
    casts = [op for op in trace.ops[:i] if op.name == "aten::to"
             and _shapes_dtypes(op.input_tensors()) == [(logits, "bfloat16")]]
    assert casts and _shapes_dtypes(casts[-1].output_tensors()) == [(logits, "float32")]


@pytest.mark.slow
def test_zero3_bf16_mixed_runs_on_cpu(tmp_path, monkeypatch):
    """DeepSpeed 0.19.8's bf16 mode on CPU: bf16 gathers, the engine's fp32 optimizer state."""
    _capture_two_ranks(tmp_path, monkeypatch, **LLAMA, parallel="zero3",
                       precision="bf16_mixed", grad_accum_steps=2)
    trace = load_trace(tmp_path / trace_file_name(1))
    gathers = [op for op in trace.collectives if op.collective.kind == "all_gather_into_tensor"]
    assert gathers and {op.collective.dtype for op in gathers} == {"bfloat16"}
    assert Counter(op.name for op in trace.ops)["aten::cross_entropy_loss"] == 2
    adam = [op for op in trace.ops if op.name in ("aten::addcdiv_", "aten::_foreach_addcdiv_")]
    assert adam and all(d == "float32" for op in adam
                        for _, d in _shapes_dtypes(op.input_tensors()))


# --- fused attention on meta ----------------------------------------------------------------

@pytest.mark.parametrize("model,precision,kernel,lse_len", [
    ("gpt", "fp32", "_scaled_dot_product_efficient_attention", 32),  # padded to 32 rows
    ("llama", "bf16", "_scaled_dot_product_flash_attention", 24)])
def test_meta_capture_keeps_nothing_seq_by_seq(tmp_path, model, precision, kernel, lse_len):
    """Fused attention on meta records the kernel CUDA's SDPA picks for the dtype (flash takes
    half precision only) with its float32 logsumexp, forward and backward, and no tensor of the
    trace has two sequence-length dimensions; math attention has such tensors."""
    seq = 24  # a size no other dimension has
    shape = dict(kind=f"{model}_dp", seq_len=seq, n_kv_heads=4 if model == "llama" else 0,
                 precision=precision)

    def seq_by_seq(folder):
        trace = load_trace(folder / trace_file_name(0))
        return trace, [op.name for op in trace.ops
                       for t in (*op.input_tensors(), *op.output_tensors())
                       if list(t.shape).count(seq) >= 2]

    meta_capture(tmp_path / "fused", 1, **shape)
    trace, found = seq_by_seq(tmp_path / "fused")
    assert found == []
    fused = [op for op in trace.ops if op.name == f"aten::{kernel}"]
    assert len(fused) == 2  # one per block (SMALL_LLAMA's two)
    for op in fused:
        (b, h, t, _), lse = op.output_tensors()[0].shape, op.output_tensors()[1]
        assert (lse.shape, str(lse.dtype)) == ((b, h, lse_len), "float32") and t == seq
    assert Counter(op.name for op in trace.ops)[f"aten::{kernel}_backward"] == 2
    meta_capture(tmp_path / "math", 1, attention="math", **shape)
    assert seq_by_seq(tmp_path / "math")[1]


# --- config ---------------------------------------------------------------------------------

@pytest.mark.parametrize("kind,model,parallel", [
    ("gpt_dp", "gpt", "ddp"), ("gpt_zero3", "gpt", "zero3"), ("gpt_local", "gpt", "local"),
    ("llama_dp", "llama", "ddp"), ("llama_zero3", "llama", "zero3"),
    ("llama_local", "llama", "local")])
def test_old_kind_names_map_to_model_and_parallel(kind, model, parallel):
    cfg = WorkloadConfig(kind=kind)
    assert (str(cfg.model), str(cfg.parallel), cfg.kind) == (model, parallel, None)
    again = WorkloadConfig(**vars(cfg))  # meta.json's round trip: the alias is gone
    assert (again.model, again.parallel) == (cfg.model, cfg.parallel)
    # Over a preset's agreeing model: as before (e.g. workload=llama_8b workload.kind=...).
    assert str(WorkloadConfig(model=model, kind=kind).parallel) == parallel


def test_old_dtype_names_map_to_precision():
    assert [str(WorkloadConfig(dtype=d).precision) for d in ("float32", "bfloat16", "float16")] \
        == ["fp32", "bf16", "fp16"]
    with pytest.raises(ConfigError, match="workload.kind='gpt_nope'; expected one of gpt_dp"):
        WorkloadConfig(kind="gpt_nope")
    with pytest.raises(ConfigError, match=r"workload.kind=llama_dp \(deprecated\) means model=llama "
                                          "parallel=ddp, but workload.parallel=fsdp2 is set"):
        WorkloadConfig(kind="llama_dp", parallel="fsdp2")
    with pytest.raises(ConfigError, match="but workload.precision=bf16_mixed is set"):
        WorkloadConfig(dtype="bfloat16", precision="bf16_mixed")


def test_old_kind_still_captures(tmp_path):
    trace, wl = _record_here(tmp_path / "old.et.json.gz", kind="gpt_local", dtype="bfloat16",
                             vocab=64, d_model=32, n_layers=1, n_heads=2, seq_len=16)
    assert trace.collectives == [] and {p.dtype for p in wl.model.parameters()} == {torch.bfloat16}


@pytest.mark.parametrize("workload,message", [
    (dict(parallel="fsdp2", device="meta"), "use workload.device=fake"),
    (dict(precision="bf16_mixed", device="meta"), "autocast, which has no meta backend"),
    (dict(parallel="zero3", precision="bf16"), "use precision=bf16_mixed"),
    (dict(grad_accum_steps=0), "workload.grad_accum_steps=0: must be >= 1"),
    (dict(activation_checkpointing="selective_layer", ac_every=0), "workload.ac_every=0")])
def test_impossible_recipes_are_refused(workload, message):
    with pytest.raises(ConfigError, match=message):
        build_workload(WorkloadConfig(**workload), 0, 1)


def test_build_workload_takes_a_mesh():
    """fsdp2 on a mesh made by the caller (the fake-device capture makes it outside its
    FakeTensorMode): the parameters become shards on that mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        mesh = init_device_mesh("cpu", (4,))
        wl = build_workload(WorkloadConfig(**LLAMA, parallel="fsdp2"), 0, 4, mesh=mesh)
        params = list(wl.model.parameters())
        assert all(isinstance(p, DTensor) and p.device_mesh is mesh for p in params)
        assert params[0].to_local().shape[0] == LLAMA["vocab"] // 4
    finally:
        dist.destroy_process_group()
