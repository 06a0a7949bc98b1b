"""The OOM study (experiment=oom_study): on a trace whose memory is known by hand, every mode on
the device, the minimum per mode, a flush that keeps a replay running where it is OOM without
one; DeepSpeed's estimate from a model's parameter counts (meta included); the study's own
traces captured once and reused."""
from __future__ import annotations

import json

import pandas as pd
import pytest
import torch
import torch.nn as nn

from actors.errors import ConfigError
from actors.replay.config import AllocationConfig, ReplayConfig
from actors.replay.engine import ReplayEngine
from actors.trace import load_trace
from orchestrator.studies import study_traces
from orchestrator.config import ExperimentConfig, RunConfig, TraceConfig
from orchestrator.study_config import MinMemoryConfig, OomStudyConfig
from orchestrator.studies.oom_study import study
from orchestrator.reports.oom_study_table import markdown, study_table
from orchestrator.outputs import RESULTS_CSV
from orchestrator.studies.zero3_estimate import nodes_of, param_counts, zero3_estimates

N = 1024  # float32 elements per tensor: 4096 B each
T = 4 * N


def capture_idle_input(path):
    """a = relu(x); b = relu(a); c = relu(b); e = neg(x), x made before the trace.

    By hand: lazy and faithful hold at most x (idle), a and b together: 3 T, the liveness
    bound. pre_allocate keeps x and every intermediate to the end: x, a, b, c, e = 5 T.
    Flushing (lazy) drops the idle x and re-creates it for the neg: each op then needs only
    its own input and output, 2 T. faithful cannot drop x (it existed before the iteration).
    """
    from torch.profiler import ExecutionTraceObserver

    x = torch.ones(N)
    et = ExecutionTraceObserver()
    et.register_callback(str(path))
    et.start()
    x.relu().relu().relu()
    x.neg()
    et.stop()
    et.unregister_callback()
    return path


@pytest.fixture(scope="module")
def idle_trace(tmp_path_factory):
    return capture_idle_input(tmp_path_factory.mktemp("idle") / "rank-0.et.json")


def _cfg(trace_dir, **study):
    return RunConfig(
        trace=TraceConfig(dir=str(trace_dir)),
        replay=ReplayConfig(mode="compute", device="meta", iters=1, warmup_iters=1,
                            allocation=AllocationConfig(mode="lazy")),
        experiment=ExperimentConfig(search="oom_study",
                                    min_memory=MinMemoryConfig(tolerance=0.0, tolerance_bytes=1),
                                    oom_study=OomStudyConfig(**study)))


def _in_process(trace_path):
    """Replays in this process with the engine the rank actors run; records each config."""
    trace = load_trace(trace_path)
    calls = []

    def replay(cfg, out_dir):
        alloc = cfg.replay.allocation
        calls.append((str(alloc.mode), alloc.device_memory_threshold,
                      cfg.replay.device_memory_capacity))
        return ReplayEngine(trace, cfg.replay).run().to_dict()
    return replay, calls


def test_study_on_a_trace_known_by_hand(idle_trace, tmp_path):
    replay, calls = _in_process(idle_trace)
    cfg = _cfg(idle_trace.parent, device_memory_capacity=str(4 * T))
    summary = study(cfg, tmp_path, replay)
    assert summary["status"] == "ok", summary["error"]
    f = summary["findings"]
    # a 4 T device: pre_allocate needs 5 T, lazy and faithful 3 T
    assert f["status_on_device"] == {"pre_allocate": "oom", "faithful": "ok", "lazy": "ok"}
    answers = {(r["replay.allocation.mode"], r["replay.allocation.device_memory_threshold"]):
               r["min_capacity_bytes"] for r in summary["rows"] if r["kind"] == "min_memory"}
    assert answers == {("pre_allocate", 1.0): 5 * T, ("faithful", 1.0): 3 * T,
                       ("lazy", 1.0): 3 * T, ("lazy", 0.5): 2 * T}
    # flush capacity: lazy's minimum with threshold 0.5 (2 T), where it is OOM without one
    flush = [r for r in summary["rows"] if r.get("study_part") == "flush"]
    assert [(r["replay.allocation.device_memory_threshold"], r["status"]) for r in flush] == \
        [(1.0, "oom"), (0.5, "ok")]
    assert all(r["replay.device_memory_capacity"] == 2 * T for r in flush)
    assert flush[1]["num_flushes"] >= 1 and flush[0]["oom_op"] == "aten::relu"
    assert f["flush_keeps_running"] is True
    table = pd.read_csv(tmp_path / RESULTS_CSV)
    assert {"study", "probe", "min_memory"} <= set(table["kind"])
    assert len(table[table["kind"] == "study"]) == 5  # 3 modes on the device, 2 flush replays
    assert not (table["kind"] == "estimate").any()  # a hand trace has no model to estimate


def test_explicit_flush_capacity_skips_the_flush_search(idle_trace, tmp_path):
    replay, calls = _in_process(idle_trace)
    cfg = _cfg(idle_trace.parent, device_memory_capacity=str(4 * T), allocation_modes=["lazy"],
               flush_capacity=str(2 * T + 100), flush_thresholds=[0.5, 0.25])
    summary = study(cfg, tmp_path, replay)
    assert summary["status"] == "ok", summary["error"]
    assert not any(t == 0.5 for m, t, c in calls if c not in (None, str(2 * T + 100)))
    flush = [(c, t) for m, t, c in calls if c == str(2 * T + 100)]
    assert flush == [(str(2 * T + 100), 1.0), (str(2 * T + 100), 0.5), (str(2 * T + 100), 0.25)]


def test_a_replay_that_fails_fails_the_study(idle_trace, tmp_path):
    def broken(cfg, out_dir):
        return {"status": "failed", "error": "rank 0 failed at node 7 aten::relu"}
    summary = study(_cfg(idle_trace.parent, allocation_modes=["lazy"], flush_capacity="8KiB"),
                    tmp_path, broken)
    assert summary["status"] == "failed"
    assert "rank 0 failed at node 7 aten::relu" in summary["error"]


@pytest.mark.parametrize("bad, match", [
    (dict(allocation_modes=[]), "allocation_modes is empty"),
    (dict(flush_mode="pre_allocate"), "never flushes"),
    (dict(flush_thresholds=[1.0]), "flush_thresholds"),
    (dict(device_memory_capacity="80 gigs"), "device_memory_capacity"),
    (dict(gpus_per_node=0), "gpus_per_node"),
])
def test_bad_settings_are_refused(bad, match):
    with pytest.raises(ConfigError, match=match):
        OomStudyConfig(**bad).validate()


def test_study_table_reads_rows_back_from_the_results_file(idle_trace, tmp_path):
    replay, _ = _in_process(idle_trace)
    study(_cfg(idle_trace.parent, device_memory_capacity=str(4 * T)), tmp_path, replay)
    records = pd.read_csv(tmp_path / RESULTS_CSV).to_dict("records")
    table = study_table(records)
    pre_row = next(r for r in records if r["kind"] == "study"
                   and r["replay.allocation.mode"] == "pre_allocate")
    pre = next(r for r in table if r["what"] == "replay pre_allocate")
    assert pre["status"] == "oom" and pre["fits 16.0 KiB"] == "no"
    assert pre["minimum capacity"] == "20.0 KiB"
    # x, a, b and c fill the 4 T device: the neg's output is the fifth tensor; its node id
    # comes from the trace itself, not from the row under test
    (neg,) = [op.node_id for op in load_trace(idle_trace).ops if op.name == "aten::neg"]
    assert int(pre_row["oom_node_id"]) == neg
    assert pre["peak (accounted)"] == f"OOM at node {neg} aten::neg (4.0 KiB requested)"
    lazy = next(r for r in table if r["what"] == "replay lazy" and r["capacity"] == "16.0 KiB")
    assert lazy["peak (accounted)"] == "12.0 KiB" and lazy["fits 16.0 KiB"] == "yes"
    assert markdown(table).splitlines()[0].startswith("| what | capacity | status |")


class _Shared(nn.Module):
    """Two Linear layers and a tied head: the head's weight is the embedding's."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(100, 8)
        self.a = nn.Linear(8, 32)
        self.b = nn.Linear(32, 8, bias=False)
        self.head = nn.Linear(8, 100, bias=False)
        self.head.weight = self.emb.weight


def test_param_counts_follow_deepspeeds_rule_on_meta_too():
    from deepspeed.runtime.zero.stage3 import model_to_params

    total, largest = 100 * 8 + 8 * 32 + 32 + 32 * 8, 100 * 8  # the embedding (and the head)
    assert param_counts(_Shared()) == model_to_params(_Shared()) == (total, largest)
    with torch.device("meta"):
        meta = _Shared()
    assert param_counts(meta) == (total, largest)
    assert model_to_params(meta)[0] < total  # every data_ptr() is 0 on meta: why we count


def test_estimates_are_deepspeeds_formula():
    total, largest = 100 * 8 + 8 * 32 + 32 + 32 * 8, 100 * 8  # counted by hand (see above)
    rows = {r["options"]: r for r in zero3_estimates(_Shared(), world_size=16, gpus_per_node=8)}
    none = rows["offload_param=none, offload_optimizer=none, zero_init=1"]
    # 18 bytes per parameter over the 16 GPUs, plus the largest layer in fp32
    assert none["estimated_gpu_bytes"] == int(4 * largest + int(18 * total / 16))
    assert rows["offload_param=cpu, offload_optimizer=cpu, zero_init=1"]["estimated_gpu_bytes"] \
        == 4 * largest
    assert none["num_nodes"] == 2 and none["gpus_per_node"] == 8
    assert nodes_of(4, 8) == (4, 1)
    with pytest.raises(ConfigError, match="whole number of nodes"):
        nodes_of(12, 8)


TINY_LLAMA = {"kind": "llama_local", "vocab": 64, "d_model": 32, "n_layers": 2, "n_heads": 4,
              "n_kv_heads": 2, "ffn_dim": 64, "seq_len": 16}


def test_workload_presets_merge_overrides_and_refuse_typos():
    cfg = study_traces.workload_config("llama_70b", {"kind": "llama_local", "seq_len": 2048})
    # The deprecated kind replaces the preset's model and parallel, and is then cleared.
    assert (cfg.d_model, cfg.n_layers, cfg.seq_len, str(cfg.model), str(cfg.parallel),
            cfg.kind, str(cfg.device), str(cfg.precision)) == \
        (8192, 80, 2048, "llama", "local", None, "meta", "bf16")
    with pytest.raises(ConfigError, match="seq_lne"):
        study_traces.workload_config("llama_70b", {"seq_lne": 1})
    with pytest.raises(ConfigError, match="llama_8b"):  # the message lists the presets
        study_traces.workload_config("llama_7b")


def test_a_preset_is_composed_by_hydra_with_its_defaults(tmp_path, monkeypatch):
    """A preset built on another (its defaults list) keeps what that one sets: Hydra composes
    it, where a hand merge of the file would drop the list."""
    import orchestrator.config

    (tmp_path / "workload").mkdir()
    (tmp_path / "workload" / "base.yaml").write_text(
        "defaults:\n  - schema\nmodel: llama\nd_model: 96\nn_layers: 3\n")
    (tmp_path / "workload" / "child.yaml").write_text("defaults:\n  - base\nseq_len: 64\n")
    monkeypatch.setattr(orchestrator.config, "CONF_DIR", tmp_path)
    monkeypatch.setattr(study_traces, "WORKLOAD_CONF_DIR", tmp_path / "workload")
    cfg = study_traces.workload_config("child", {"n_heads": 4})
    assert (str(cfg.model), cfg.d_model, cfg.n_layers, cfg.seq_len, cfg.n_heads,
            str(cfg.device)) == ("llama", 96, 3, 64, 4, "meta")
    with pytest.raises(ConfigError, match="experiment.oom_study.workload='nope'.*base, child"):
        study_traces.workload_config("nope")


def test_a_preset_is_composed_inside_a_running_hydra_app():
    """tracefleet's OOM study composes its preset while tracefleet's own Hydra app runs, where
    Hydra is initialized already and refuses a second initialization: the app's is used."""
    from hydra import initialize_config_dir

    from orchestrator.config import CONF_DIR

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = study_traces.workload_config("llama_8b", {"n_layers": 1})
    assert (str(cfg.model), cfg.n_layers, str(cfg.device)) == ("llama", 1, "meta")


def test_capture_is_cached_and_its_model_rebuilt(tmp_path, monkeypatch):
    folder = study_traces.cached_capture("llama_8b", TINY_LLAMA, 1, str(tmp_path))
    assert (folder / "rank-0.et.json.gz").is_file()
    assert json.loads((folder / "meta.json").read_text())["workload"]["d_model"] == 32
    assert [p.name for p in tmp_path.iterdir()] == [folder.name]  # no temporary left behind

    def no_capture(*args, **kwargs):
        raise AssertionError("captured again")
    monkeypatch.setattr("orchestrator.run.capture.run_capture_job", no_capture)
    assert study_traces.cached_capture("llama_8b", TINY_LLAMA, 1, str(tmp_path)) == folder
    other = dict(TINY_LLAMA, seq_len=32)
    with pytest.raises(AssertionError, match="captured again"):  # another workload: new capture
        study_traces.cached_capture("llama_8b", other, 1, str(tmp_path))
    model, world = study_traces.traced_model(folder)
    # embedding and head 64 x 32 each; per block: wq, wo 32 x 32, wk, wv 32 x 16, w1, w2, w3
    # 32 x 64, two norms of 32; the final norm
    block = 2 * 32 * 32 + 2 * 32 * 16 + 3 * 32 * 64 + 2 * 32
    assert world == 1 and param_counts(model) == (2 * 64 * 32 + 2 * block + 32, 64 * 32)
    assert study_traces.traced_model(tmp_path) is None


def test_the_report_shows_the_study(idle_trace, tmp_path):
    from orchestrator.outputs import OOM_STUDY_PNG, REPORT_PLOTS_DIR
    from orchestrator.reports.html_report import write_report

    replay, _ = _in_process(idle_trace)
    study(_cfg(idle_trace.parent, device_memory_capacity=str(4 * T)), tmp_path, replay)
    page = write_report(tmp_path).read_text()
    assert "<h2>OOM study</h2>" in page and "replay pre_allocate" in page
    assert "alt='minimum capacity per mode and estimate' src='data:image/png;base64," in page
    assert (tmp_path / REPORT_PLOTS_DIR / OOM_STUDY_PNG).stat().st_size > 1000


def test_an_oom_outside_an_op_says_so():
    row = {"kind": "study", "study_part": "device", "replay.allocation.mode": "pre_allocate",
           "replay.allocation.device_memory_threshold": 1.0, "replay.device_memory_capacity": 100,
           "status": "oom", "oom_node_id": float("nan"), "oom_op": None, "num_flushes": 0,
           "oom_requested_bytes": 2048}
    (line,) = study_table([row])
    assert line["peak (accounted)"] == "OOM outside an op (2.0 KiB requested)"
    assert line["fits 100 B"] == "no"
    (line,) = study_table([dict(row, oom_node_id=42, oom_op="aten::mm")])
    assert line["peak (accounted)"] == "OOM at node 42 aten::mm (2.0 KiB requested)"
