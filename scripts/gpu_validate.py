"""The GPU side of tracefleet's memory model checked on one GPU, in one command
(scripts/gpu_validate.sh runs this; docs/prediction.md says how to read it).

Cases, each within the time budget (the rest are reported as skipped):

* ``demo_trace``: the bundled demo trace replayed on cuda; the caching allocator model fed by
  that replay against ``max_memory_reserved`` / ``max_memory_allocated`` of the same replay;
* ``fsdp2_llama_<ac>``: a real FSDP2 world-1 Llama training step in bf16 mixed precision (NCCL
  at world 1), once per activation-checkpointing mode: its measured peaks against
  ``tracefleet-predict``'s for the same recipe (captured on fake, as a user's would be); one
  recorded iteration replayed on cuda with its collectives through NCCL, its time beside the
  original step's;
* ``transformers_llama``: a Hugging Face ``LlamaForCausalLM`` (a small config, no download)
  trained on the GPU, when transformers is installed, against its prediction.

Each GPU run is recorded with ``torch.cuda.memory._record_memory_history`` and compared with
the predicted snapshot (``tracefleet-compare``'s figures). The last line printed is one JSON
object. Without a GPU: one line saying so, exit 0.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import socket
import statistics
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BUDGET_S = 330.0  # the whole run stays under 6 minutes with the CUDA tests before it
AC_MODES = ("none", "full", "selective_layer", "selective_op")
# A Llama small enough for any GPU, large enough that tensors, not the allocator's fixed
# costs, decide the peak: ~120 M parameters, 8 x 1024 tokens per step.
LLAMA = {"vocab": 32000, "d_model": 1024, "n_layers": 8, "n_heads": 16, "n_kv_heads": 8,
         "ffn_dim": 2816, "seq_len": 1024, "batch_size": 8}
HF_CONFIG = {"vocab_size": 32000, "hidden_size": 768, "intermediate_size": 2048,
             "num_hidden_layers": 6, "num_attention_heads": 12, "num_key_value_heads": 4,
             "max_position_embeddings": 512}
HF_BATCH = (8, 512)  # batch x sequence
NUM_WARMUP, NUM_STEPS = 2, 3
ERROR_BAND = 0.03  # tracefleet-predict's default band (conf/predict.yaml)
NO_GPU = "gpu_validate: no CUDA GPU here (torch.cuda.is_available() is False): nothing to run"


# --- what runs on the CPU too (tests/test_gpu_validate.py) -------------------------------------
def workload_overrides(ac: str, dims: dict = LLAMA) -> list[str]:
    """tracefleet-predict's overrides for the FSDP2 bf16 Llama case with ``ac``."""
    return ["workload=llama3_8b", "world_size=1", f"workload.activation_checkpointing={ac}",
            "workload.batch_size=" + str(dims["batch_size"]),
            *(f"workload.{k}={v}" for k, v in dims.items() if k != "batch_size")]


def real_workload(ac: str, dims: dict = LLAMA):
    """The FSDP2 bf16 Llama case as the GPU trains it (the same recipe the prediction
    captures on fake)."""
    from actors.capture.workloads.config import WorkloadConfig

    return WorkloadConfig(model="llama", parallel="fsdp2", precision="bf16_mixed",
                          activation_checkpointing=ac, device="cuda", **dims)


def hf_overrides(target: list[str]) -> list[str]:
    """tracefleet-predict's overrides for the transformers case (hf_build as the entrypoint)."""
    return ["workload=custom", f"workload.entrypoint={Path(__file__).resolve()}:hf_build",
            "world_size=1", *target]


def target_overrides(total_memory: int, compute_major: int, compute_minor: int = 0
                     ) -> list[str]:
    """A target that is this GPU's caching allocator alone: the CUDA context and NCCL's
    buffers are outside it (and outside max_memory_reserved), cuBLAS's workspace is PyTorch's
    default for the architecture (Hopper and later: 32 MiB), its kernels this GPU's (where
    ``GpuArch`` names the architecture; sm90 otherwise)."""
    from actors.gpu_arch import GpuArch

    workspace = os.environ.get("CUBLAS_WORKSPACE_CONFIG") or \
        (":4096:8" if compute_major >= 9 else ":4096:2:16:8")
    arch = f"sm{compute_major}{compute_minor}"
    kernels = [f"target.arch={arch}"] if arch in {a.value for a in GpuArch} else []
    return ["target=custom", f"target.device_memory={total_memory}", "target.cuda_context=0",
            "target.nccl_num_peers=0", f"target.cublas_workspace_config='{workspace}'", *kernels]


# the encoder case's sizes (examples/fsdp2_transformer_encoder_step.py reads them)
ENCODER = {"EXAMPLE_DIM": "1024", "EXAMPLE_LAYERS": "4", "EXAMPLE_HEADS": "16",
           "EXAMPLE_SEQ": "2048", "EXAMPLE_BATCH": "4", "EXAMPLE_VOCAB": "32000",
           "EXAMPLE_DROPOUT": "0.1"}
ENCODER_STEP = REPO / "examples" / "fsdp2_transformer_encoder_step.py"


def encoder_overrides(target: list[str]) -> list[str]:
    """tracefleet-predict's overrides for the encoder case: the example step at world 1."""
    return ["workload=custom", f"workload.entrypoint={ENCODER_STEP}:build", "world_size=1",
            *target]


def predict_case(overrides: list[str], out_dir: Path, cache_dir: Path) -> dict:
    """tracefleet-predict with ``overrides`` and the snapshot on, into ``out_dir``."""
    from orchestrator.cli.predict import predict_config
    from orchestrator.studies.predict import predict

    cfg = predict_config(*overrides, "predict.snapshot=true", f"predict.cache_dir={cache_dir}")
    return predict(cfg, out_dir).to_dict()  # compared key by key with the measured run's


def against(measured: dict, predicted: dict, recorded: Path | None, predicted_dir: Path | None,
            ) -> dict:
    """One case's figures: predicted / measured per peak, and the snapshots compared."""
    out = {"measured_reserved_bytes": measured["reserved_bytes"],
           "measured_allocated_bytes": measured["allocated_bytes"],
           "predicted_reserved_bytes": predicted["predicted_reserved_peak_bytes"],
           "predicted_allocated_bytes": predicted["predicted_allocated_peak_bytes"]}
    out["ratio_reserved"] = round(out["predicted_reserved_bytes"] / out["measured_reserved_bytes"],
                                  4) if out["measured_reserved_bytes"] else None
    out["ratio_allocated"] = round(out["predicted_allocated_bytes"] /
                                   out["measured_allocated_bytes"], 4) \
        if out["measured_allocated_bytes"] else None
    out["within_band"] = out["ratio_reserved"] is not None and \
        abs(out["ratio_reserved"] - 1) <= ERROR_BAND
    if recorded is not None and predicted_dir is not None:
        out["snapshots"] = compare_snapshots(recorded, predicted_dir)
    return out


def compare_snapshots(recorded: Path, prediction: Path) -> dict:
    """tracefleet-compare's figures (peaks, first and lasting divergence) of two snapshots."""
    from orchestrator.cli.compare import predicted_file
    from orchestrator.reports.snapshot_compare import compare
    from orchestrator.reports.snapshot_file import read_snapshot

    c = compare(read_snapshot(recorded), read_snapshot(predicted_file(prediction, None)))
    return {k: c[k] for k in ("ratio_allocated", "ratio_reserved", "num_matched_allocs",
                              "first_divergence", "lasting_divergence", "num_realignments")}


def summarize(cases: list[dict], cuda_tests: dict | None, gpu: str | None,
              total_s: float) -> dict:
    """The JSON line: every case, the largest reserved error, and ``ok`` (no case failed,
    every compared case within the error band, the CUDA tests passed)."""
    compared = [c for c in cases if c.get("ratio_reserved") is not None]
    errors = [abs(c["ratio_reserved"] - 1) for c in compared]
    failed = [c["case"] for c in cases if c.get("error")]
    ok = not failed and all(c["within_band"] for c in compared) and \
        (cuda_tests is None or cuda_tests.get("returncode") == 0)
    return {"gpu": gpu, "ok": ok, "cases": cases, "cuda_tests": cuda_tests,
            "max_abs_error_reserved": round(max(errors), 4) if errors else None,
            "num_cases": len(cases), "failed": failed,
            "skipped": [c["case"] for c in cases if c.get("skipped")],
            "error_band": ERROR_BAND, "total_s": round(total_s, 1)}


def hf_build(ctx):
    """A workload entrypoint (actors/capture/workloads/custom.py): a small Hugging Face Llama,
    AdamW, bf16 autocast, on ``ctx.device``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device(ctx.device):
        model = LlamaForCausalLM(LlamaConfig(**HF_CONFIG))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator(device="cpu").manual_seed(ctx.rank)

    def make_batch():
        ids = torch.randint(0, HF_CONFIG["vocab_size"], HF_BATCH, generator=gen)
        return (ids.to(ctx.device),)

    def step(batch):
        (ids,) = batch
        with torch.autocast(ctx.device.type, dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return model, make_batch, step


# --- the GPU runs -----------------------------------------------------------------------------
class Budget:
    """Seconds left of BUDGET_S; a case that would start past it is skipped."""

    def __init__(self, seconds: float):
        self.end = time.perf_counter() + seconds

    def left(self) -> float:
        return self.end - time.perf_counter()


def _measure(run, record_path: Path) -> dict:
    """Run ``run()`` (returns step times) from an empty caching allocator, recording its
    history; the peaks it reached."""
    import torch

    torch.cuda.synchronize()
    if hasattr(torch._C, "_cuda_clearCublasWorkspaces"):  # made again inside, as predicted
        torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before_reserved, before_allocated = torch.cuda.memory_reserved(), torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=2_000_000)
    try:
        times = run()
        torch.cuda.synchronize()
        torch.cuda.memory._dump_snapshot(str(record_path))
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    return {"reserved_bytes": torch.cuda.max_memory_reserved() - before_reserved,
            "allocated_bytes": torch.cuda.max_memory_allocated() - before_allocated,
            "step_s": statistics.median(times) if times else None}


def demo_case(out: Path, target: list[str]) -> dict:
    """The demo trace replayed on cuda against the model fed by that replay."""
    from actors.replay.config import AllocationConfig, ReplayConfig
    from actors.replay.memory.model_recording import pop_snapshot
    from actors.replay.memory.target import TargetConfig
    from actors.replay.session import RankSession
    from actors.trace import load_trace
    from orchestrator.config import DEMO_TRACES

    fields = dict(o.split("=", 1) for o in target[1:])
    tcfg = TargetConfig(name="custom", device_memory=fields["target.device_memory"],
                        cuda_context="0", nccl_num_peers=0,
                        cublas_workspace_config=fields["target.cublas_workspace_config"]
                        .strip("'"))
    cfg = ReplayConfig(mode="compute", device="cuda", iters=2, warmup_iters=1,
                       measure_memory=False, allocation=AllocationConfig(mode="faithful"),
                       allocator_snapshot=True)
    engine = RankSession(cfg, target=tcfg).compile(
        load_trace(DEMO_TRACES / "gpt_dp_4" / "rank-0.et.json.gz"))
    reports = {}

    def run():
        reports["r"] = engine.run().to_dict()
        return reports["r"]["iteration_times_s"]

    try:
        measured = _measure(run, out / "demo_recorded.pickle")
    finally:
        engine.close()
    report = reports["r"]
    (out / "demo_predicted").mkdir(exist_ok=True)
    (out / "demo_predicted" / "snapshot_rank0.pickle").write_bytes(pop_snapshot(report))
    return {"replay_step_s": measured["step_s"], **against(
        measured, report, out / "demo_recorded.pickle", out / "demo_predicted")}


def _init_world_one():
    import torch.distributed as dist

    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                world_size=1)


def _steps(workload, device) -> list[float]:
    import torch

    for _ in range(NUM_WARMUP):
        workload.step(workload.next_batch())
    times = []
    for _ in range(NUM_STEPS):
        batch = workload.next_batch()
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        workload.step(batch)
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return times


def fsdp2_case(ac: str, out: Path, target: list[str], cache: Path) -> dict:
    """The real FSDP2 world-1 Llama step against its prediction; its trace replayed on cuda."""
    import torch

    from actors.capture.workloads.context import world_mesh
    from actors.capture.recorder import record_iteration
    from actors.capture.workloads.build import build_workload

    _init_world_one()
    device = torch.device("cuda", 0)
    wl = real_workload(ac)
    held = {}

    def run():
        held["w"] = build_workload(wl, 0, 1, device, world_mesh("cuda", 1))
        return _steps(held["w"], device)

    recorded = out / f"fsdp2_{ac}_recorded.pickle"
    measured = _measure(run, recorded)
    trace = out / f"fsdp2_{ac}_trace" / "rank-0.et.json.gz"
    trace.parent.mkdir(exist_ok=True)
    w = held.pop("w")
    record_iteration(w.step, w.next_batch(), w.model, step_index=NUM_WARMUP + NUM_STEPS,
                     out_path=str(trace), tensor_ranges=True)
    del w
    torch.cuda.empty_cache()
    replay_s = _replay_on_cuda(trace)
    prediction = predict_case(workload_overrides(ac) + target, out / f"fsdp2_{ac}_predicted",
                              cache)
    return {"original_step_s": measured["step_s"], "replay_step_s": replay_s,
            **against(measured, prediction, recorded, out / f"fsdp2_{ac}_predicted")}


def _replay_on_cuda(trace_path: Path) -> float | None:
    """Median iteration time of the trace replayed on cuda, collectives through NCCL."""
    import torch

    from actors.replay.comm.rank_comm import rank_comm
    from actors.replay.config import ReplayConfig
    from actors.replay.session import RankSession
    from actors.trace import load_trace

    trace = load_trace(trace_path)
    cfg = ReplayConfig(mode="full", device="cuda", iters=NUM_STEPS, warmup_iters=1,
                       measure_memory=False)
    device = torch.device("cuda", 0)
    comm = rank_comm(trace.process_groups, 0, 1, device, timeout_s=cfg.collective_timeout_s,
                     ops=trace.ops)
    report = RankSession(cfg, device=device).run(trace, comm)
    if report["status"] != "ok":
        raise RuntimeError(f"replay on cuda: {report['error']}")
    return report["iteration_time_s"]


def transformers_case(out: Path, target: list[str], cache: Path) -> dict:
    """A Hugging Face Llama trained on the GPU against its prediction (captured on fake)."""
    import torch

    from actors.capture.workloads.context import CaptureContext, world_mesh

    _init_world_one()
    device = torch.device("cuda", 0)
    ctx = CaptureContext(device, 0, 1, world_mesh("cuda", 1))
    recorded = out / "transformers_recorded.pickle"

    def run():
        model, make_batch, step = hf_build(ctx)
        from types import SimpleNamespace
        return _steps(SimpleNamespace(step=step, next_batch=make_batch), device)

    measured = _measure(run, recorded)
    torch.cuda.empty_cache()
    prediction = predict_case(hf_overrides(target), out / "transformers_predicted", cache)
    return {"original_step_s": measured["step_s"],
            **against(measured, prediction, recorded, out / "transformers_predicted")}


def encoder_case(out: Path, target: list[str], cache: Path) -> dict:
    """nn.TransformerEncoder with torch's default dropout 0.1 trained on the GPU (flash
    attention with dropout, fused dropout masks) against its prediction, whose capture on fake
    runs the same kernels (docs/capture.md, "CPU and CUDA paths")."""
    import torch

    from actors.capture.workloads.context import CaptureContext, world_mesh
    from actors.capture.workloads.custom import load_build

    os.environ.update(ENCODER)
    _init_world_one()
    device = torch.device("cuda", 0)
    ctx = CaptureContext(device, 0, 1, world_mesh("cuda", 1))
    recorded = out / "encoder_recorded.pickle"

    def run():
        from types import SimpleNamespace
        model, make_batch, step = load_build(f"{ENCODER_STEP}:build")(ctx)
        return _steps(SimpleNamespace(step=step, next_batch=make_batch), device)

    measured = _measure(run, recorded)
    torch.cuda.empty_cache()
    prediction = predict_case(encoder_overrides(target), out / "encoder_predicted", cache)
    return {"original_step_s": measured["step_s"],
            "kernels": [(r["op"], r["kernel"]) for r in prediction["kernel_dispatch"]],
            **against(measured, prediction, recorded, out / "encoder_predicted")}


def cuda_tests(timeout_s: float) -> dict:
    """The CUDA-marked tests (pytest -m cuda), bounded."""
    import subprocess

    t0 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p",
                               "no:cacheprovider", "tests"], cwd=REPO, capture_output=True,
                              text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"returncode": None, "summary": f"timed out after {timeout_s:.0f} s"}
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    return {"returncode": proc.returncode, "summary": lines[-1] if lines else "",
            "seconds": round(time.perf_counter() - t0, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="where the snapshots and predictions go "
                                                   "(default: a new folder under /tmp)")
    parser.add_argument("--skip-tests", action="store_true", help="skip pytest -m cuda")
    parser.add_argument("--budget-s", type=float, default=BUDGET_S)
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print(NO_GPU)
        return 0
    t0 = time.perf_counter()
    budget = Budget(args.budget_s)
    out = Path(args.out or f"/tmp/tracefleet-gpu-validate-{int(time.time())}")
    out.mkdir(parents=True, exist_ok=True)
    cache = out / "cache"
    props = torch.cuda.get_device_properties(0)
    target = target_overrides(props.total_memory, props.major, props.minor)
    tests = None if args.skip_tests else cuda_tests(min(150.0, budget.left() / 2))
    cases = [("demo_trace", lambda: demo_case(out, target))]
    cases += [(f"fsdp2_llama_{ac}", lambda ac=ac: fsdp2_case(ac, out, target, cache))
              for ac in AC_MODES]
    if importlib.util.find_spec("transformers") is not None:
        cases.append(("transformers_llama", lambda: transformers_case(out, target, cache)))
    cases.append(("encoder_dropout", lambda: encoder_case(out, target, cache)))
    results = []
    for name, run in cases:
        if budget.left() < 20:
            results.append({"case": name, "skipped": "time budget spent"})
            continue
        start = time.perf_counter()
        try:
            results.append({"case": name, **run()})
        except Exception as e:  # one broken case is reported; the others still run
            results.append({"case": name, "error": f"{type(e).__name__}: {e}"[:500],
                            "traceback": traceback.format_exc(limit=4)[-1500:]})
        results[-1]["seconds"] = round(time.perf_counter() - start, 1)
        print(f"gpu_validate: {name}: " + json.dumps({k: v for k, v in results[-1].items()
                                                        if k != "traceback"}), flush=True)
    summary = summarize(results, tests, torch.cuda.get_device_name(0),
                        time.perf_counter() - t0)
    summary["out_dir"] = str(out)
    print(json.dumps(summary))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
