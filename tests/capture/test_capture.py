"""Trace capture: tiny captures on a local Ray cluster (traces, profiler traces, the original's
memory), CPU against meta capture of the same Llama, the CLI's error path, the demo traces."""
from __future__ import annotations

import gzip
import json
import os
import shutil
import statistics
import subprocess
import sys
from collections import Counter
from pathlib import Path

import orjson
import pytest
import ray

from actors.trace.conventions import (BWD_BEGIN, BWD_END, FORWARD, MODULE_PREFIX, kineto_file_name,
                            module_range_name, parse_module_range, trace_file_name)
from actors.capture.workloads.models.gpt.model import Block
from actors.capture.workloads.build import WorkloadConfig, build_model
from actors.capture.request import CaptureRequest
from actors.errors import ConfigError
from actors.trace import compute_liveness, load_trace
from actors.trace.kineto import host_gaps_s, host_times, kineto_path_for, read_kineto
from actors.trace.stats import trace_stats
from orchestrator.run.capture import CaptureConfig, prepare_out_dir, run_capture_job
from orchestrator.config import REPO_ROOT, ClusterConfig
from tests.capture.test_capture_meta import SMALL_LLAMA, meta_capture
from tests.support.bounds import CAPTURE_BOUND_S, CLUSTER_START_S

REPO = REPO_ROOT
DEMO = REPO / "demo" / "traces"
TINY = dict(vocab=64, d_model=32, n_layers=1, n_heads=2, seq_len=16, batch_size=2)
DEMO_FOLDERS = {"gpt_dp_4": ("ddp", 4), "gpt_zero3_2": ("zero3", 2),
                "gpt_zero3_leaf_2": ("zero3", 2)}
MAX_DEMO_FOLDER_BYTES = 2 * 2**20


@pytest.fixture(scope="module")
def torch_extensions_dir(tmp_path_factory) -> Path:
    """The capture ranks' TORCH_EXTENSIONS_DIR, empty as in a fresh clone."""
    return tmp_path_factory.mktemp("torch_extensions")


@pytest.fixture(scope="module")
def ray_cluster(torch_extensions_dir):
    temp_dir = f"/tmp/tf-captest-{os.getpid()}"  # short: Ray's socket paths are length-limited
    ray.init(num_cpus=4, include_dashboard=False, _temp_dir=temp_dir, log_to_driver=False,
             runtime_env={"env_vars": {"TORCH_EXTENSIONS_DIR": str(torch_extensions_dir)}})
    yield
    ray.shutdown()
    shutil.rmtree(temp_dir, ignore_errors=True)


def _capture(out_dir: Path, warmup_iters: int = 1, base: dict = TINY, **workload) -> dict:
    cfg = CaptureConfig(workload=WorkloadConfig(**{**base, **workload}), world_size=2,
                        warmup_iters=warmup_iters, timing_iters=2, out_dir=str(out_dir),
                        capture_timeout_s=CAPTURE_BOUND_S, cluster=ClusterConfig(timeout_s=CLUSTER_START_S))
    return run_capture_job(cfg).meta


def _params(wl: WorkloadConfig) -> list:
    return list(build_model(wl)[0].parameters())


def _raw_names(path: Path) -> list[str]:
    """Node names in execution (id) order."""
    nodes = orjson.loads(gzip.decompress(path.read_bytes()))["nodes"]
    return [n["name"] for n in sorted(nodes, key=lambda n: n["id"])]


def _signatures(trace) -> list[tuple]:
    """(kind, in elements, out elements, dtype) of every collective, in order."""
    return [op.collective.signature() for op in trace.collectives]


def _fetch_units(model, leaf: bool) -> list[tuple[str, int, int]]:
    """(qualname, elements, tensors) of each ZeRO-3 fetch, in forward order.

    A module's own parameters are gathered together; a leaf Block with its whole subtree.
    """
    units, leaf_prefixes = [], []
    for qualname, module in model.named_modules():
        if qualname.startswith(tuple(leaf_prefixes)):
            continue  # inside a leaf block: fetched with it
        if leaf and isinstance(module, Block):
            leaf_prefixes.append(f"{qualname}.")
            params = list(module.parameters())
        else:
            params = list(module.parameters(recurse=False))
        if params:
            units.append((qualname, sum(p.numel() for p in params), len(params)))
    return units


@pytest.fixture(scope="module")
def dp_capture(ray_cluster, tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("gpt_dp_2")
    # Two warm-up iterations: the measured (last) one starts with the optimizer state made.
    return out_dir, _capture(out_dir, warmup_iters=2)


def test_dp_capture_writes_rank_traces_and_meta(dp_capture):
    out_dir, meta = dp_capture
    assert sorted(p.name for p in out_dir.iterdir()) == [
        "meta.json", "rank-0.et.json.gz", "rank-0.kineto.json.gz", "rank-1.et.json.gz",
        "rank-1.kineto.json.gz"]
    on_disk = json.loads((out_dir / "meta.json").read_text())
    assert on_disk["world_size"] == 2
    assert (on_disk["workload"]["model"], on_disk["workload"]["parallel"]) == ("gpt", "ddp")
    # Eager times: per rank the median of its timed iterations, overall the median of ranks.
    assert all(len(r["iteration_times_s"]) == 2 and min(r["iteration_times_s"]) > 0
               and r["iteration_time_s"] == statistics.median(r["iteration_times_s"])
               for r in on_disk["ranks"])
    assert on_disk["rank_iteration_time_s"] == [r["iteration_time_s"] for r in on_disk["ranks"]]
    assert on_disk["iteration_time_s"] == statistics.median(on_disk["rank_iteration_time_s"])
    assert on_disk["num_params"] == sum(p.numel() for p in _params(WorkloadConfig(**TINY)))
    assert [r["kineto_file"] for r in on_disk["ranks"]] == [kineto_file_name(r) for r in range(2)]
    # the machine, and the profiler's own cost per op (a fraction of a microsecond to a few;
    # a wall-clock difference, so 0 or tens of microseconds on a machine the suite loads)
    assert all(r["machine"]["cpu_model"] and r["machine"]["num_threads"] >= 1
               and r["machine"]["num_cpus"] >= 1 for r in on_disk["ranks"])
    assert all(0 <= r["profiler_op_cost_s"] < 1e-3 and r["profiler_cost"]["events_per_op"] == 1
               for r in on_disk["ranks"])


def test_the_original_is_timed_again_from_its_meta(dp_capture):
    """bench_fidelity's reference: the capture workload rebuilt from meta.json alone, trained
    on round after round, timed as capture times it (slowest rank per iteration)."""
    from orchestrator.run.original import OriginalWorkload

    out_dir, _ = dp_capture
    meta = json.loads((out_dir / "meta.json").read_text())
    with OriginalWorkload(meta, timeout_s=240) as original:
        first, second = original.time(3), original.time(2)
    assert len(first) == 3 and len(second) == 2 and min(first + second) > 0
    with pytest.raises(ConfigError, match="names no capture workload"):
        OriginalWorkload({"world_size": 2, "ranks": []})


def test_dp_capture_measures_the_originals_memory(dp_capture):
    """meta.json's memory per the contract, and plausible: when the measured iteration starts,
    parameters, last iteration's gradients and AdamW's two moments are alive (4 x the
    parameter bytes, computed from the model); inside it activations come on top."""
    out_dir, meta = dp_capture
    on_disk = json.loads((out_dir / "meta.json").read_text())
    param_bytes = 4 * on_disk["num_params"]  # float32
    ranks = on_disk["ranks"]
    for r in ranks:
        assert r["iteration_start_bytes"] >= 4 * param_bytes
        assert r["peak_memory_bytes"] > r["iteration_start_bytes"]
        assert r["peak_memory_bytes"] < 4 * param_bytes + 2 * 2**20  # no stray megabytes
    memory = on_disk["memory"]
    assert memory["method"].startswith("CPU allocator counter")
    assert memory["peak_bytes"] == max(r["peak_memory_bytes"] for r in ranks)
    assert memory["iteration_start_bytes"] == max(r["iteration_start_bytes"] for r in ranks)


def test_dp_host_gaps_are_the_non_op_time_of_the_step(dp_capture):
    """Each gap is the host thread's idle time between two consecutive profiled ops, less the
    time it sat blocked on other threads' work (gloo's worker threads run the sync
    all-reduces): recomputed here from the raw events, interval by interval, so the check
    holds on a loaded machine too. Nothing is counted twice. The ops the bare timing
    iteration did not run come from the module ranges' hooks."""
    out_dir, meta = dp_capture
    for rank in range(2):
        trace = load_trace(out_dir / trace_file_name(rank))
        kineto = kineto_path_for(trace.path)
        assert kineto == out_dir / kineto_file_name(rank)
        gaps = host_gaps_s(trace, kineto)
        assert len(gaps) == len(trace.ops) and sum(gaps) > 0
        events = [e for e in read_kineto(kineto) if e.get("ph") == "X"]
        step = next(e for e in events if e.get("name") == trace.steps[0].name)
        spans = {e["args"]["Record function id"]: e for e in events
                 if e.get("cat") == "cpu_op" and "Record function id" in e.get("args", {})}
        linked = [i for i, op in enumerate(trace.ops) if op.rf_id in spans]
        unlinked = [op for op in trace.ops if op.rf_id not in spans]
        assert all(spans[trace.ops[i].rf_id]["tid"] == step["tid"] for i in linked)  # one thread
        # At most a few of the autograd engine's gradient accumulations (their order can move
        # with the markers' hooks); no hook adds an op (actors/capture/backward_markers.py).
        assert all(op.module == "" and op.name in ("aten::add", "aten::add_") for op in unlinked)
        assert not any(op.module == "BackwardHookFunction" for op in trace.ops)
        assert all(gaps[i] == 0.0 for i, op in enumerate(trace.ops) if op.rf_id not in spans)
        other_ends = sorted(e["ts"] + e.get("dur", 0) for e in events if e["tid"] != step["tid"])
        assert any(str(e.get("name")).startswith("gloo:") for e in events)
        prev_end, num_blocked = step["ts"], 0
        for i in linked:
            start = spans[trace.ops[i].rf_id]["ts"]
            blocked = [end for end in other_ends if prev_end < end <= start]
            num_blocked += bool(blocked)
            expected_us = max(0.0, start - max([prev_end, *blocked]))
            assert gaps[i] * 1e6 == pytest.approx(expected_us, abs=1e-3), (rank, i)
            prev_end = start + spans[trace.ops[i].rf_id]["dur"]
        assert num_blocked > 0  # the all-reduces' waits were found and left out
        op_us = sum(spans[trace.ops[i].rf_id]["dur"] for i in linked)
        assert op_us + sum(gaps) * 1e6 <= step["dur"] * 1.001


def test_dp_traces_have_step_ranges_and_modules(dp_capture):
    out_dir, _ = dp_capture
    for rank in range(2):
        trace = load_trace(out_dir / trace_file_name(rank))
        assert trace.rank == rank
        assert [s.name for s in trace.steps] == ["ProfilerStep#4"]  # 2 warm-up + 2 timed
        assert trace.steps[0].first == 0 and trace.steps[0].end == len(trace.ops)
        # The embedding's indices carry their value range: [0, vocab).
        embeddings = [op for op in trace.ops if op.name == "aten::embedding"]
        assert embeddings and all(op.tensor_ranges for op in embeddings)
        lo, hi = embeddings[0].tensor_ranges[1]
        assert 0 <= lo <= hi < TINY["vocab"]
        modules = {op.module for op in trace.ops if op.module.startswith(MODULE_PREFIX)}
        assert module_range_name("blocks.0.attn.qkv") in modules
        assert module_range_name("head") in modules
        names = _raw_names(out_dir / trace_file_name(rank))
        begin = names.index(module_range_name("blocks.0.mlp", BWD_BEGIN))
        end = names.index(module_range_name("blocks.0.mlp", BWD_END))
        assert "aten::mm" in names[begin:end]  # the MLP's backward lies between its markers


def test_dp_collectives_match_across_ranks(dp_capture):
    out_dir, meta = dp_capture
    sigs = [_signatures(load_trace(out_dir / trace_file_name(r))) for r in range(2)]
    assert sigs[0] == sigs[1]
    params = _params(WorkloadConfig(**TINY))
    assert len(sigs[0]) == len(params)  # one all-reduce per gradient
    assert {s[0] for s in sigs[0]} == {"all_reduce"} and {s[3] for s in sigs[0]} == {"float32"}
    assert sum(s[1] for s in sigs[0]) == meta["num_params"]


@pytest.fixture(scope="module", params=[False, True], ids=["plain", "leaf"])
def zero3_capture(request, ray_cluster, tmp_path_factory):
    out_dir = tmp_path_factory.mktemp(f"gpt_zero3_{request.param}")
    return out_dir, request.param, _capture(out_dir, kind="gpt_zero3", leaf_modules=request.param)


def test_zero3_collectives_match_across_ranks(zero3_capture, torch_extensions_dir):
    out_dir, leaf, meta = zero3_capture
    # Nothing was compiled: the default skips DeepSpeed's shm comm op (training never uses it).
    assert meta["shm_comm_op"].startswith("skipped") and not any(torch_extensions_dir.iterdir())
    assert meta["deepspeed_version"] and meta["workload"]["leaf_modules"] is leaf
    sigs = [_signatures(load_trace(out_dir / trace_file_name(r))) for r in range(2)]
    assert sigs[0] and sigs[0] == sigs[1]
    data = [s for s in sigs[0] if s[0] in ("all_gather_into_tensor", "reduce_scatter_tensor")]
    assert {s[0] for s in data} == {"all_gather_into_tensor", "reduce_scatter_tensor"}
    assert {s[3] for s in data} == {"float32"}
    # The rest is the step's gradient norm: one element, in DeepSpeed's norm dtype.
    assert [s for s in sigs[0] if s not in data] == [("all_reduce", 1, 1, "float64")]
    # Every gradient element is reduce-scattered once; ZeRO-3 pads each tensor to a multiple
    # of the world size (2), so at most one element more per tensor.
    scattered = sum(s[1] for s in sigs[0] if s[0] == "reduce_scatter_tensor")
    num_tensors = len(_params(WorkloadConfig(**TINY)))
    assert meta["num_params"] <= scattered <= meta["num_params"] + num_tensors


def _check_zero3_gathers(trace, wl: WorkloadConfig, world_size: int) -> None:
    """One all-gather per fetch unit in forward, inside the unit's range, and one in backward."""
    units = _fetch_units(build_model(wl)[0], wl.leaf_modules)
    gathers = [op for op in trace.collectives if op.collective.kind == "all_gather_into_tensor"]
    # No prefetch and no reuse (the workload's defaults): each unit is gathered in forward,
    # released, and gathered again in backward.
    assert len(gathers) == 2 * len(units)
    forward = gathers[:len(units)]
    # The fetch runs in the module's pre-forward hook, inside its range; its flat buffer holds
    # the unit's parameters, each padded to a multiple of the world size.
    assert [op.module for op in forward] == [module_range_name(u[0]) for u in units]
    for op, (qualname, numel, num_tensors) in zip(forward, units):
        assert numel <= op.collective.out_nelems <= numel + num_tensors * (world_size - 1), qualname


def test_zero3_gathers_once_per_module_or_leaf_block(zero3_capture):
    out_dir, leaf, _ = zero3_capture
    _check_zero3_gathers(load_trace(out_dir / trace_file_name(0)),
                         WorkloadConfig(**TINY, leaf_modules=leaf), world_size=2)


def test_prepare_out_dir_refuses_stale_rank_traces(tmp_path):
    (tmp_path / "rank-3.et.json.gz").write_bytes(b"old")
    with pytest.raises(ConfigError, match="already holds 1 rank trace"):
        prepare_out_dir(str(tmp_path), overwrite=False)
    prepare_out_dir(str(tmp_path), overwrite=True)
    assert not (tmp_path / "rank-3.et.json.gz").exists()


def test_config_errors_are_precise():
    with pytest.raises(ConfigError, match="unknown workload key"):
        CaptureRequest.from_dict({"workload": {"d_modle": 3}})
    with pytest.raises(ConfigError, match="not divisible"):
        CaptureConfig(workload=WorkloadConfig(d_model=30, n_heads=4)).validate()


def _cli(tmp_path, *overrides):
    return subprocess.run(
        [sys.executable, "-m", "orchestrator.cli.capture", *overrides,
         f"out_dir={tmp_path / 'out'}", f"hydra.run.dir={tmp_path / 'hydra'}"],
        capture_output=True, text=True, timeout=120, cwd=REPO)


def test_cli_refuses_bad_values_before_any_work(tmp_path):
    proc = _cli(tmp_path, "workload.kind=gpt_nope")  # Hydra refuses the choice at compose time
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == "" and "gpt_nope" in proc.stderr and "llama_dp" in proc.stderr
    proc = _cli(tmp_path, "workload.kind=llama_zero3", "workload.device=meta")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [
        "tracefleet-capture: error: workload.parallel=zero3 runs DeepSpeed, which needs real "
        "tensors; on workload.device=meta use workload.parallel=local (plain traces for the "
        "ZeRO-3 emulation) or ddp"]
    assert not (tmp_path / "out").exists()  # refused before any work


def test_cli_meta_capture_prints_one_line(tmp_path):
    proc = _cli(tmp_path, "workload.kind=llama_dp", "workload.device=meta", "world_size=3",
                "workload.d_model=32", "workload.n_heads=4", "workload.vocab=64",
                "workload.n_layers=1", "workload.seq_len=8")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        f"tracefleet-capture: wrote 3 rank traces "
        f"({sum(p.stat().st_size for p in (tmp_path / 'out').glob('rank-*')) / 1024:.0f} KiB) "
        f"and meta.json to {tmp_path / 'out'}"]


@pytest.mark.slow
def test_llama_on_cpu_and_on_meta_agree(ray_cluster, tmp_path):
    """The same small Llama captured on CPU (gloo, real data) and on meta (fake group): the same
    ops, all-reduces, parameters and liveness bound. One exception, counted: the autograd
    engine accumulates a gradient that several uses produce in place on CPU (``add_``) and
    out of place on meta (``add``), because torch treats meta tensors as subclass-like
    (ATen/TensorSubclassLikeUtils.h) and only accumulates plain tensors in place. And attention:
    meta records the kernel a GPU runs for fp32, memory-efficient attention, cpu CPU's flash
    kernel; the GPU kernel's logsumexp is padded to 32 rows and it keeps a philox seed and
    offset (int64 scalars) for backward. One intra-op thread on CPU: a parallel kernel's
    scratch allocations on pool threads are top-level ops of their own thread."""
    cpu_dir, meta_dir = tmp_path / "cpu", tmp_path / "meta"
    cfg = CaptureConfig(workload=WorkloadConfig(**SMALL_LLAMA), world_size=2, warmup_iters=1,
                        timing_iters=1, num_threads=1, record_kineto=False, out_dir=str(cpu_dir),
                        capture_timeout_s=CAPTURE_BOUND_S, cluster=ClusterConfig(timeout_s=CLUSTER_START_S))
    run_capture_job(cfg)
    meta_capture(meta_dir, 2)
    cpu, meta = (load_trace(d / trace_file_name(1)) for d in (cpu_dir, meta_dir))

    def engine_adds(trace):  # the autograd engine's own ops sit in no module or node range
        return Counter(op.name for op in trace.ops
                       if op.module == "" and op.name in ("aten::add", "aten::add_"))

    cpu_engine, meta_engine = engine_adds(cpu), engine_adds(meta)
    in_place = cpu_engine["aten::add_"]
    assert in_place > 0 and meta_engine == Counter({"aten::add": cpu_engine.total()})
    expected = Counter(op.name for op in cpu.ops)
    expected["aten::add_"] -= in_place
    expected["aten::add"] += in_place
    for cpu_name, gpu_name in (
            ("aten::_scaled_dot_product_flash_attention_for_cpu",
             "aten::_scaled_dot_product_efficient_attention"),
            ("aten::_scaled_dot_product_flash_attention_for_cpu_backward",
             "aten::_scaled_dot_product_efficient_attention_backward")):
        expected[gpu_name] = expected.pop(cpu_name)
    assert Counter(op.name for op in meta.ops) == +expected
    assert [op.collective.signature() for op in cpu.collectives] == \
        [op.collective.signature() for op in meta.collectives]
    cpu_stats, meta_stats = trace_stats(cpu), trace_stats(meta)
    assert cpu_stats["params"] == meta_stats["params"]
    # Equal up to the few bytes of 0-dim CPU scalars whose address reuse varies by run, and
    # per block what the GPU kernel keeps more (computed): logsumexp rows padded from 16 to 32
    # (float32 per batch and head) and the seed and offset.
    gpu_extra = SMALL_LLAMA["n_layers"] * (
        SMALL_LLAMA["batch_size"] * SMALL_LLAMA["n_heads"] * (32 - SMALL_LLAMA["seq_len"]) * 4 + 16)
    assert compute_liveness(meta.ops, meta.num_storages).lower_bound_bytes - compute_liveness(
        cpu.ops, cpu.num_storages).lower_bound_bytes == pytest.approx(gpu_extra, abs=64)


def test_module_range_names_round_trip():
    assert parse_module_range(module_range_name("blocks.0.attn")) == ("blocks.0.attn", FORWARD)
    assert parse_module_range(module_range_name("", BWD_END)) == ("", BWD_END)
    assert parse_module_range("ProfilerStep#3") is None


@pytest.mark.parametrize("folder", sorted(DEMO_FOLDERS))
def test_demo_traces_load_and_agree_across_ranks(folder):
    parallel, world_size = DEMO_FOLDERS[folder]
    path = DEMO / folder
    assert sorted(p.name for p in path.iterdir()) == sorted(
        ["meta.json"] + [trace_file_name(r) for r in range(world_size)]
        + [kineto_file_name(r) for r in range(world_size)])
    assert sum(p.stat().st_size for p in path.iterdir()) < MAX_DEMO_FOLDER_BYTES
    meta = json.loads((path / "meta.json").read_text())
    assert (meta["world_size"], meta["workload"]["model"], meta["workload"]["parallel"]) == \
        (world_size, "gpt", parallel)
    assert meta["iteration_time_s"] > 0
    param_bytes = 4 * meta["num_params"]
    # ZeRO-3 keeps 1/world of the parameters and of AdamW's state, plus DeepSpeed's buffers.
    least = 4 * param_bytes if parallel == "ddp" else 3 * param_bytes // world_size
    assert meta["memory"]["peak_bytes"] > meta["memory"]["iteration_start_bytes"] >= least
    for r in range(world_size):  # the ops link to the profiler trace
        trace = load_trace(path / trace_file_name(r))
        host = host_times(trace, path / kineto_file_name(r))
        # the gaps are part of the profiled step (the eager time, measured apart, may be less
        # on a loaded machine)
        assert len(host.gaps_s) == len(trace.ops) and 0 < sum(host.gaps_s) < host.step_s
    traces = [load_trace(path / trace_file_name(r)) for r in range(world_size)]
    assert [t.rank for t in traces] == list(range(world_size))
    for t in traces:  # exactly the recorded iteration
        assert len(t.steps) == 1 and (t.steps[0].first, t.steps[0].end) == (0, len(t.ops))
    sigs = [_signatures(t) for t in traces]
    assert sigs[0] and all(s == sigs[0] for s in sigs[1:])
    if parallel == "ddp":  # gradient buckets: every gradient element all-reduced once
        assert {(s[0], s[3]) for s in sigs[0]} == {("all_reduce", "float32")}
        assert sum(s[1] for s in sigs[0]) == meta["num_params"]


@pytest.mark.parametrize("folder", ["gpt_zero3_2", "gpt_zero3_leaf_2"])
def test_demo_zero3_gathers_once_per_module_or_leaf_block(folder):
    meta = json.loads((DEMO / folder / "meta.json").read_text())
    _check_zero3_gathers(load_trace(DEMO / folder / trace_file_name(0)),
                         WorkloadConfig(**meta["workload"]), meta["world_size"])
