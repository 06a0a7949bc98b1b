"""Trace capture: tiny captures on a local Ray cluster, the CLI's error path, the demo traces."""
from __future__ import annotations

import gzip
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
import ray

from actors.capture import (BWD_BEGIN, BWD_END, FORWARD, MODULE_PREFIX, module_range_name,
                            parse_module_range, trace_file_name)
from actors.capture.workloads import GPT, Block, WorkloadConfig
from actors.capture.worker import workload_config
from actors.errors import ConfigError
from actors.trace import load_trace
from orchestrator.capture_main import CaptureConfig, prepare_out_dir, run_capture_job
from orchestrator.cluster import ClusterConfig

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "demo" / "traces"
TINY = dict(vocab=64, d_model=32, n_layers=1, n_heads=2, seq_len=16, batch_size=2)
DEMO_FOLDERS = {"gpt_dp_4": ("gpt_dp", 4), "gpt_zero3_2": ("gpt_zero3", 2),
                "gpt_zero3_leaf_2": ("gpt_zero3", 2)}
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


def _capture(out_dir: Path, **workload) -> dict:
    cfg = CaptureConfig(workload=WorkloadConfig(**{**TINY, **workload}), world_size=2,
                        warmup_iters=1, timing_iters=2, out_dir=str(out_dir),
                        capture_timeout_s=240, cluster=ClusterConfig(timeout_s=60))
    return run_capture_job(cfg)


def _raw_names(path: Path) -> list[str]:
    """Node names in execution (id) order."""
    nodes = orjson.loads(gzip.decompress(path.read_bytes()))["nodes"]
    return [n["name"] for n in sorted(nodes, key=lambda n: n["id"])]


def _signatures(trace) -> list[tuple]:
    """(kind, in elements, out elements, dtype) of every collective, in order."""
    return [op.collective.signature() for op in trace.collectives]


def _fetch_units(model: GPT, leaf: bool) -> list[tuple[str, int, int]]:
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
    return out_dir, _capture(out_dir)


def test_dp_capture_writes_rank_traces_and_meta(dp_capture):
    out_dir, meta = dp_capture
    assert sorted(p.name for p in out_dir.iterdir()) == ["meta.json", "rank-0.et.json.gz",
                                                         "rank-1.et.json.gz"]
    on_disk = json.loads((out_dir / "meta.json").read_text())
    assert on_disk["world_size"] == 2 and on_disk["workload"]["kind"] == "gpt_dp"
    # Eager times: per rank the median of its timed iterations, overall the median of ranks.
    assert all(len(r["iteration_times_s"]) == 2 and min(r["iteration_times_s"]) > 0
               and r["iteration_time_s"] == statistics.median(r["iteration_times_s"])
               for r in on_disk["ranks"])
    assert on_disk["rank_iteration_time_s"] == [r["iteration_time_s"] for r in on_disk["ranks"]]
    assert on_disk["iteration_time_s"] == statistics.median(on_disk["rank_iteration_time_s"])
    assert on_disk["num_params"] == sum(p.numel() for p in GPT(WorkloadConfig(**TINY)).parameters())


def test_dp_traces_have_step_ranges_and_modules(dp_capture):
    out_dir, _ = dp_capture
    for rank in range(2):
        trace = load_trace(out_dir / trace_file_name(rank))
        assert trace.rank == rank
        assert [s.name for s in trace.steps] == ["ProfilerStep#3"]
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
    params = list(GPT(WorkloadConfig(**TINY)).parameters())
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
    num_tensors = len(list(GPT(WorkloadConfig(**TINY)).parameters()))
    assert meta["num_params"] <= scattered <= meta["num_params"] + num_tensors


def _check_zero3_gathers(trace, wl: WorkloadConfig, world_size: int) -> None:
    """One all-gather per fetch unit in forward, inside the unit's range, and one in backward."""
    units = _fetch_units(GPT(wl), wl.leaf_modules)
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
        workload_config({"workload": {"d_modle": 3}})
    with pytest.raises(ConfigError, match="not divisible"):
        CaptureConfig(workload=WorkloadConfig(d_model=30, n_heads=4)).validate()


def test_cli_reports_a_bad_value_in_one_line(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "orchestrator.capture_main", "workload.kind=gpt_nope",
         f"out_dir={tmp_path / 'out'}", f"hydra.run.dir={tmp_path / 'hydra'}"],
        capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    assert proc.stderr.splitlines() == [
        "tracefleet-capture: error: workload.kind='gpt_nope': expected one of gpt_dp, gpt_zero3"]
    assert not (tmp_path / "out").exists()  # refused before any work


def test_module_range_names_round_trip():
    assert parse_module_range(module_range_name("blocks.0.attn")) == ("blocks.0.attn", FORWARD)
    assert parse_module_range(module_range_name("", BWD_END)) == ("", BWD_END)
    assert parse_module_range("ProfilerStep#3") is None


@pytest.mark.parametrize("folder", sorted(DEMO_FOLDERS))
def test_demo_traces_load_and_agree_across_ranks(folder):
    kind, world_size = DEMO_FOLDERS[folder]
    path = DEMO / folder
    assert sorted(p.name for p in path.iterdir()) == \
        ["meta.json"] + [trace_file_name(r) for r in range(world_size)]
    assert sum(p.stat().st_size for p in path.iterdir()) < MAX_DEMO_FOLDER_BYTES
    meta = json.loads((path / "meta.json").read_text())
    assert (meta["world_size"], meta["workload"]["kind"]) == (world_size, kind)
    assert meta["iteration_time_s"] > 0
    traces = [load_trace(path / trace_file_name(r)) for r in range(world_size)]
    assert [t.rank for t in traces] == list(range(world_size))
    for t in traces:  # exactly the recorded iteration
        assert len(t.steps) == 1 and (t.steps[0].first, t.steps[0].end) == (0, len(t.ops))
    sigs = [_signatures(t) for t in traces]
    assert sigs[0] and all(s == sigs[0] for s in sigs[1:])
    if kind == "gpt_dp":  # gradient buckets: every gradient element all-reduced once
        assert {(s[0], s[3]) for s in sigs[0]} == {("all_reduce", "float32")}
        assert sum(s[1] for s in sigs[0]) == meta["num_params"]


@pytest.mark.parametrize("folder", ["gpt_zero3_2", "gpt_zero3_leaf_2"])
def test_demo_zero3_gathers_once_per_module_or_leaf_block(folder):
    meta = json.loads((DEMO / folder / "meta.json").read_text())
    _check_zero3_gathers(load_trace(DEMO / folder / trace_file_name(0)),
                         WorkloadConfig(**meta["workload"]), meta["world_size"])
