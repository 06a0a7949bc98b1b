"""Predicted reserved memory: the allocator model fed by a replay (reserved_model.py), the
target's figures (target.py), and the MemoryTracker's observer hook."""
from __future__ import annotations

import pytest

from actors.errors import ConfigError
from actors.replay.config import AllocationConfig, ReplayConfig
from actors.replay.engine import ReplayEngine
from actors.replay.memory.accounting import MemoryTracker
from actors.replay.memory.model_recording import reserved_model_extensions
from actors.replay.memory.reserved_model import ReservedMemoryModel
from actors.replay.memory.target import CudaAllocatorConfig, TargetConfig, cublas_workspace_bytes
from actors.trace import load_trace
from orchestrator.config import DEMO_TRACES, REPO_ROOT

MiB = 1 << 20
DEMO = DEMO_TRACES / "gpt_dp_4"


class _Recorder:
    def __init__(self):
        self.events = []

    def held(self, suid, nbytes):
        self.events.append(("held", suid, nbytes))

    def released(self, suid):
        self.events.append(("released", suid))

    def charged(self, nbytes, category, host=False):
        self.events.append(("charged", nbytes))

    def discharged(self, nbytes, category, host=False):
        self.events.append(("discharged", nbytes))


def test_memory_tracker_reports_transitions_only():
    memory = MemoryTracker(4, None)
    rec = _Recorder()
    memory.observe(rec)
    memory.add(1, 100)
    memory.add(1, 100)  # already held: nothing
    memory.add_new(2, 50)  # the op loop's variant (observed: add itself)
    assert memory.release(3) == 0  # never held: nothing
    assert memory.release(1) == 100  # TensorStore.drop
    memory.charge(7)
    memory.discharge(7)
    assert rec.events == [("held", 1, 100), ("held", 2, 50), ("released", 1),
                          ("charged", 7), ("discharged", 7)]
    assert list(memory.held) == [0, 0, 50, 0]  # the values are stored as before


def _dry_run(mode: str, target: TargetConfig):
    cfg = ReplayConfig(mode="compute", device="meta", iters=2, warmup_iters=1,
                       allocation=AllocationConfig(mode=mode))
    ext = ReservedMemoryModel(target)
    report = ReplayEngine(load_trace(DEMO / "rank-0.et.json.gz"), cfg, extensions=[ext]).run()
    return report.to_dict(), ext


@pytest.mark.parametrize("mode", ["lazy", "faithful", "pre_allocate"])
def test_meta_dry_run_predicts_reserved_above_allocated(mode):
    report, ext = _dry_run(mode, TargetConfig(name="h100_80gb"))
    assert report["status"] == "ok", report["error"]
    reserved = report["predicted_reserved_peak_bytes"]
    allocated = report["predicted_allocated_peak_bytes"]
    # 512 B rounding and the 32 MiB Hopper cuBLAS workspace only add to the accounted peak
    assert reserved >= allocated >= report["accounted_peak_bytes"] + 32 * MiB > 32 * MiB
    assert reserved % (2 * MiB) == 0  # whole segments
    model = ext.model
    # every storage the iterations made was freed again: what stays allocated is the
    # workspace plus the policy's persistent storages (rounded up)
    assert 0 <= model.allocated_bytes - 32 * MiB - report["persistent_bytes"] < 512 * 2000
    assert report["cuda_allocator"]["target"]["usable_capacity_bytes"] == \
        80 * 1024 * MiB - 512 * MiB - 16 * MiB
    assert report["num_alloc_retries"] == 0


def test_a_small_target_retries_and_then_runs_out():
    tight = TargetConfig(name="custom", device_memory="600MiB", cuda_context="512MiB",
                         nccl_num_peers=0, cublas_workspace_config=":0:0")
    report, ext = _dry_run("pre_allocate", tight)
    assert report["status"] == "ok"  # the accounted OOM check is not the model's business
    assert ext.model.capacity_bytes == 88 * MiB
    big, _ = _dry_run("pre_allocate", TargetConfig(name="custom", device_memory="100GiB",
                                                   nccl_num_peers=0,
                                                   cublas_workspace_config=":0:0"))
    # the same stream needs less than 88 MiB reserved: no retry at all
    assert big["predicted_reserved_peak_bytes"] < 88 * MiB
    tiny = TargetConfig(name="custom", device_memory="530MiB", cuda_context="512MiB",
                        nccl_num_peers=0, cublas_workspace_config=":0:0")
    report, ext = _dry_run("pre_allocate", tiny)
    assert report["num_predicted_ooms"] == ext.model.num_ooms > 0
    assert report["cuda_allocator"]["first_oom"]["request_bytes"] > 0
    assert report["num_alloc_retries"] >= ext.model.num_ooms  # each OOM retried first


def test_expandable_segments_through_the_target():
    plain, _ = _dry_run("lazy", TargetConfig(name="a100_80gb"))
    conf = CudaAllocatorConfig(pytorch_cuda_alloc_conf="expandable_segments:True")
    target = TargetConfig(name="a100_80gb", allocator=conf)
    grown, ext = _dry_run("lazy", target)
    assert ext.model.expandable and grown["cuda_allocator"]["settings"]["expandable_segments"]
    assert grown["predicted_allocated_peak_bytes"] <= grown["predicted_reserved_peak_bytes"]
    # one address range per pool, its tail unmapped: the expandable path served the stream
    assert ext.model.large_pool.unmapped and ext.model.small_pool.unmapped
    assert plain["cuda_allocator"]["settings"]["expandable_segments"] is False


def test_target_figures_name_their_defaults():
    figures = TargetConfig(name="a100_40gb").figures()
    assert figures["device_memory_bytes"] == 40 * 1024 * MiB
    assert figures["nccl_buffer_bytes"] == 4 * MiB * 2 * 2
    assert figures["cublas_workspace_bytes"] == 4096 * 1024 * 2 + 16 * 1024 * 8
    assert figures["usable_capacity_bytes"] == 40 * 1024 * MiB - 512 * MiB - 16 * MiB
    assert "NCCL_BUFFSIZE 4MiB" in figures["defaults"]["nccl"]
    assert "default" in figures["defaults"]["cuda_context"]
    assert cublas_workspace_bytes(":4096:8") == 32 * MiB
    assert reserved_model_extensions(TargetConfig()) == []


def test_bad_target_values_are_config_errors():
    for target, match in ((TargetConfig(name="custom"), "device_memory"),
                          (TargetConfig(name="h100_80gb", cublas_workspace_config="4096"),
                           "cublas_workspace_config"),
                          (TargetConfig(name="h100_80gb", cuda_context="90GiB"), "leave nothing"),
                          (TargetConfig(name="h100_80gb", allocator=CudaAllocatorConfig(
                              max_split_size_mb=4)), "max_split_size_mb")):
        with pytest.raises(ConfigError, match=match):
            target.validate()
    with pytest.raises(ConfigError, match="target.name"):
        TargetConfig(name="h100")


def test_summary_and_console_carry_the_prediction():
    from rich.console import Console

    from orchestrator.run.aggregate import aggregate
    from orchestrator.reports.run_report import print_summary
    from tests.orchestrator.reports.test_metrics_report import ok_report

    reports = [ok_report(0, 0.1), ok_report(1, 0.2)]
    for r, (reserved, retries) in zip(reports, ((300, 1), (500, 2))):
        r.update(predicted_reserved_peak_bytes=reserved * MiB,
                 predicted_allocated_peak_bytes=(reserved - 50) * MiB, num_alloc_retries=retries)
    target = TargetConfig(name="h100_80gb").figures()
    summary = aggregate(reports, world_size=2, extra={"target": target})
    assert summary["predicted_reserved_peak_bytes"] == 500 * MiB  # the worst rank
    assert summary["predicted_allocated_peak_bytes"] == 450 * MiB
    assert summary["num_alloc_retries"] == 3  # summed over ranks
    assert [r["predicted_reserved_peak_bytes"] for r in summary["ranks"]] == [300 * MiB, 500 * MiB]
    console = Console(record=True, width=250)
    print_summary(summary, console=console)
    text = console.export_text()
    row0 = next(line for line in text.splitlines() if "10.0.0.0" in line and " ok " in line)
    assert row0.split()[6:9] == ["100.0", "90.0", "300.0"]  # measured, accounted, reserved*
    text = " ".join(text.split())  # the footer may wrap
    assert "reserved* 500.0 MiB predicted" in text and "3 alloc retries" in text
    assert "does not fit" not in text
    reports[1]["num_predicted_ooms"] = 4
    console = Console(record=True, width=250)
    print_summary(aggregate(reports, world_size=2, extra={"target": target}), console=console)
    assert "does not fit the target: 4 OOMs" in " ".join(console.export_text().split())
    assert "target h100_80gb" in text and "NCCL_BUFFSIZE 4MiB" in text and ":4096:8" in text
    from orchestrator.results import summary_columns
    row = summary_columns(summary)  # a sweep's results table (e.g. over targets)
    assert row["predicted_reserved_peak_bytes"] == 500 * MiB and row["num_alloc_retries"] == 3
    plain = aggregate([ok_report(0, 0.1)], world_size=1)
    assert plain["predicted_reserved_peak_bytes"] is None and plain["num_alloc_retries"] is None


def test_rank_actor_models_zero3_charges_too(monkeypatch):
    """The rank actor puts the model before ZeRO-3's extension, so the shards and gathered
    buffers it charges are allocations too, and every discharge frees one of them."""
    from actors.rank_actor import RankActor, ReplayRequest
    from actors.zero3.config import Zero3Config

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    actor = RankActor()
    monkeypatch.setattr(actor, "_where", lambda: {"node_ip": "127.0.0.1", "node_id": "node"})
    cfg = ReplayConfig(mode="compute", device="meta", iters=1, warmup_iters=0,
                       allocation=AllocationConfig(mode="lazy"))
    zero3 = Zero3Config(strategy="per_module", param_persistence_threshold=0)
    plain = actor.replay(ReplayRequest(str(DEMO / "rank-0.et.json.gz"), None, cfg, [],
                         target=TargetConfig(name="a100_80gb")))
    report = actor.replay(ReplayRequest(str(DEMO / "rank-0.et.json.gz"), None, cfg, [],
                                        zero3=zero3, target=TargetConfig(name="a100_80gb")))
    assert report["status"] == plain["status"] == "ok", report["error"]
    model = report["cuda_allocator"]
    assert model["num_unmatched_discharges"] == 0
    assert report["predicted_allocated_peak_bytes"] >= report["accounted_peak_bytes"] > 0
    assert model["num_allocs"] > plain["cuda_allocator"]["num_allocs"]  # the charges
    assert report.get("predicted_reserved_peak_bytes") and \
        "predicted_reserved_peak_bytes" not in actor.replay(ReplayRequest(
            str(DEMO / "rank-0.et.json.gz"), None, cfg, []))  # no target: no model


@pytest.mark.long
def test_tracefleet_dry_run_with_a_target_reports_reserved(tmp_path):
    """End to end: `tracefleet replay=dry_run target=a100_40gb` on one rank of the demo."""
    import json
    import os
    import shutil
    import subprocess
    import sys
    import tempfile

    repo = REPO_ROOT
    ray_dir = tempfile.mkdtemp(prefix="tf-ca-", dir="/tmp")  # Ray's socket paths must be short
    try:
        proc = subprocess.run(
            [sys.executable, "-c", "from orchestrator.cli.main import main; main()", "replay=dry_run",
             "target=a100_40gb", "trace.ranks=[0]", f"hydra.run.dir={tmp_path}/run",
             f"cluster.temp_dir={ray_dir}", "target.allocator.max_split_size_mb=64",
             "replay.allocator_snapshot=true"],
            capture_output=True, text=True, timeout=300, cwd=tmp_path,
            env={**os.environ, "PYTHONPATH": str(repo)})
    finally:
        shutil.rmtree(ray_dir, ignore_errors=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    reserved = summary["predicted_reserved_peak_bytes"]
    allocated = summary["predicted_allocated_peak_bytes"]
    assert reserved >= allocated > summary["accounted_peak_bytes"] > 0
    assert summary["num_alloc_retries"] == 0
    assert summary["target"]["name"] == "a100_40gb"
    [rank] = summary["ranks"]
    assert rank["predicted_reserved_peak_bytes"] == reserved
    assert rank["cuda_allocator"]["settings"]["max_split_size_bytes"] == 64 * MiB
    assert "reserved*" in proc.stdout and "target a100_40gb" in proc.stdout
    # replay.allocator_snapshot: the model's snapshot as a file, not in the summary
    assert summary["snapshots"] == {"0": "snapshot_rank0.pickle"}
    assert "snapshot_pickle" not in rank["cuda_allocator"]
    from orchestrator.reports.snapshot_file import read_snapshot
    from tests.support.memory_viz import replay_history
    snap = read_snapshot(tmp_path / "run" / "snapshot_rank0.pickle")
    assert replay_history(snap)["peak_reserved"] == reserved


def test_every_target_preset_composes():
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from orchestrator.cli.schemas import register_all
    from orchestrator.config import CONF_DIR

    register_all()
    presets = sorted(p.stem for p in (CONF_DIR / "target").glob("*.yaml"))
    assert presets == ["a100_40gb", "a100_80gb", "custom", "h100_80gb", "h100_96gb",
                       "h200_141gb", "none"]
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        assert not OmegaConf.to_object(compose("tracefleet")).target.enabled  # default: none
        for name in presets:
            extra = ["target.device_memory=100GiB"] if name == "custom" else []
            run = OmegaConf.to_object(compose("tracefleet", overrides=[f"target={name}", *extra]))
            run.validate()
            assert str(run.target.name) == name
            if name == "none":
                continue
            figures = run.target.figures()
            hopper = name.startswith(("h100", "h200"))
            workspace = 32 * MiB if hopper else 8 * MiB + 128 * 1024
            assert figures["cublas_workspace_bytes"] == workspace
            assert figures["usable_capacity_bytes"] == figures["device_memory_bytes"] - 528 * MiB


def test_optimizer_state_is_requested_at_the_first_optimizer_step():
    """torch.optim makes AdamW's state in the first step(), after the first backward: the
    model serves the state held before the replay when the warm-up's optimizer step first
    allocates, not ahead of the first forward's activations."""
    from actors.replay.memory.reserved_model import OPTIMIZER_RANGE
    from actors.trace.categories import OPTIMIZER_STATE

    trace = load_trace(DEMO / "rank-0.et.json.gz")
    assert any(op.module.startswith(OPTIMIZER_RANGE) for op in trace.ops)
    ext = ReservedMemoryModel(TargetConfig(name="h100_80gb"))
    requests = []  # the op running at each request, in order (None: before the first op)
    order = {}  # id(block) -> its request's position
    malloc = ext.model.malloc

    def logged(nbytes, stream=0):
        step = ext._memory.step if ext._memory is not None else None
        requests.append(None if step is None else step.op)
        block = malloc(nbytes, stream)
        order[id(block)] = len(requests) - 1
        return block

    ext.model.malloc = logged
    cfg = ReplayConfig(mode="compute", device="meta", iters=1, warmup_iters=1,
                       allocation=AllocationConfig(mode="faithful"))
    engine = ReplayEngine(trace, cfg, extensions=[ext])
    report = engine.run().to_dict()
    assert report["status"] == "ok", report["error"]
    state = [s for s, c in enumerate(engine.memory.categories) if c == OPTIMIZER_STATE
             and engine.memory.held[s]]
    assert state  # the demo's AdamW state, held through the replay
    first_optimizer = next(i for i, op in enumerate(requests)
                           if op is not None and op.module.startswith(OPTIMIZER_RANGE))
    assert any(op is not None for op in requests[:first_optimizer])  # the forward came first
    assert ext._lazy_state is None
    assert all(order[id(ext._blocks[s])] >= first_optimizer for s in state)
