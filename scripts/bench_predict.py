"""Prediction benchmark: the predicted peak of a training job against its measured peak; one
JSON line.

For every configuration (small enough to run for real here, 2 ranks each; the mesh rows 4:
``WORLDS``):

* ``measured``: the real CPU run's measured peak, max over ranks (``tracefleet-capture`` on
  cpu: ``meta.json`` memory, the CPU allocation counter over the last warm-up iteration);
* ``predicted``: the same recipe captured on the fake device at the same world size, then a
  dry run on meta in ``faithful`` mode (memory held as the original held it), accounted
  peak, max over the distinct rank traces. DeepSpeed cannot run on fake: its rows predict
  from a plain (``parallel=local``) capture replayed with the ZeRO-3 emulation
  (``zero3.layout=deepspeed``) at the job's world size;
* ``ratio`` = predicted / measured (target 0.97-1.03);
* FSDP2 rows also run PyTorch's own estimator, ``FSDPMemTracker`` under FakeTensorMode over
  the fake process group, as the anchor (``fsdp_mem_tracker_ratio``).

Rows: the built-in recipes (``_recipe``), DeepSpeed's through the ZeRO-3 emulation, and the
ecosystem's own training steps (:data:`ECOSYSTEM`: examples/ written as users write them, with
transformers, torchvision and ``torch.nn`` built-ins, each sized by its EXAMPLE_* variables).

    python scripts/bench_predict.py [--configs NAME ...] [--quick] [--keep DIR]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from actors.trace.conventions import trace_file_name  # noqa: E402
from orchestrator.outputs import RunDir  # noqa: E402
from scripts.json_layout import EACH, emit  # noqa: E402
from actors.replay.config import AllocationConfig, ReplayConfig  # noqa: E402
from actors.replay.session import replay_rank  # noqa: E402
from actors.zero3.config import Zero3Config  # noqa: E402
from actors.zero3.extension import zero3_extensions  # noqa: E402

WORLD = 2
TARGET = (0.97, 1.03)
MODEL = dict(model="llama", vocab=512, d_model=256, n_layers=4, n_heads=4, seq_len=256,
             batch_size=4)
TINY = dict(model="llama", vocab=64, d_model=64, n_layers=2, n_heads=4, seq_len=32,
            batch_size=2)
# The custom entrypoint's model, sized like MODEL (examples/fsdp2_llama_step.py reads these).
EXAMPLE_ENV = {"EXAMPLE_DIM": "256", "EXAMPLE_LAYERS": "4", "EXAMPLE_HEADS": "4",
               "EXAMPLE_VOCAB": "512", "EXAMPLE_SEQ": "256", "EXAMPLE_BATCH": "4"}
CUSTOM = dict(model="custom", entrypoint=str(ROOT / "examples" / "fsdp2_llama_step.py") + ":build")
# Sizes of the ecosystem's steps: the recipes' decoder (EXAMPLE_ENV) where the model is one.
LM_ENV = {**EXAMPLE_ENV, "EXAMPLE_KV_HEADS": "2"}


def _example(file: str, env: dict) -> dict:
    return {"entrypoint": str(ROOT / "examples" / file) + ":build", "env": env}


# name -> a user's step under examples/ and its sizes (measured for real like the others)
ECOSYSTEM = {
    "hf_llama_fsdp2_hf_checkpointing": _example("hf_llama_fsdp2_checkpointing.py", LM_ENV),
    "hf_qwen2_fsdp2_bf16_mixed": _example("hf_qwen2_fsdp2_bf16.py", LM_ENV),
    # batched_mm experts gather every chosen expert's weights per token: a smaller model
    "hf_mixtral_moe_fsdp2_sgd_clip_accum": _example("hf_mixtral_moe_step.py", {
        "EXAMPLE_DIM": "128", "EXAMPLE_LAYERS": "2", "EXAMPLE_HEADS": "4", "EXAMPLE_VOCAB": "512",
        "EXAMPLE_SEQ": "128", "EXAMPLE_BATCH": "2"}),
    "hf_gpt2_ddp_autocast_accum": _example("ddp_gpt2_step.py", EXAMPLE_ENV),
    "nn_transformer_encoder_fsdp2_checkpoint": _example(
        "transformer_encoder_checkpoint_step.py", EXAMPLE_ENV),
    # every block compiled before it is sharded, as torchtitan does (inductor, measured for real)
    "fsdp2_llama_compiled_per_block_bf16_mixed": _example(
        "fsdp2_llama_step.py", {**EXAMPLE_ENV, "EXAMPLE_COMPILE": "1"}),
    # FSDP1 (flat parameters, bf16 MixedPrecision, each block a unit), as HF Trainer wraps
    "fsdp1_full_shard_bf16_mixed": _example("fsdp1_llama_step.py", EXAMPLE_ENV),
    "fsdp1_shard_grad_op_bf16_mixed": _example("fsdp1_llama_step.py", {
        **EXAMPLE_ENV, "EXAMPLE_STRATEGY": "SHARD_GRAD_OP"}),
    "fsdp1_hybrid_shard_bf16_mixed": _example("fsdp1_llama_step.py", {
        **EXAMPLE_ENV, "EXAMPLE_STRATEGY": "HYBRID_SHARD"}),
    "fsdp1_full_shard_flat_params_bf16_mixed": _example("fsdp1_llama_step.py", {
        **EXAMPLE_ENV, "EXAMPLE_ORIG_PARAMS": "0"}),
    # DeepSpeed's own engine from the user's config (bf16), captured on fake as it runs
    "deepspeed_engine_zero1_bf16": _example("deepspeed_llama_step.py", {
        **EXAMPLE_ENV, "EXAMPLE_ZERO_STAGE": "1"}),
    "deepspeed_engine_zero2_bf16": _example("deepspeed_llama_step.py", {
        **EXAMPLE_ENV, "EXAMPLE_ZERO_STAGE": "2"}),
    # PEFT LoRA on every projection of a frozen HF Llama under FSDP2: adapters' gradients
    # and optimizer state only
    "peft_lora_fsdp2_bf16_mixed": _example("peft_lora_fsdp2_step.py", LM_ENV),
    "torchvision_resnet18_ddp": _example("ddp_resnet_step.py",
                                         {"EXAMPLE_IMAGE": "64", "EXAMPLE_BATCH": "8"}),
}
# The same steps at their tiny defaults (--quick).
ECOSYSTEM_TINY = {name: {**row, "env": {}} for name, row in ECOSYSTEM.items()}


def _recipe(parallel, precision, ac="none"):
    return dict(parallel=parallel, precision=precision, activation_checkpointing=ac)


CONFIGS = {
    "ddp_fp32": _recipe("ddp", "fp32"),
    "ddp_bf16_mixed_full_ac": _recipe("ddp", "bf16_mixed", "full"),
    "fsdp2_fp32": _recipe("fsdp2", "fp32"),
    "fsdp2_bf16_mixed": _recipe("fsdp2", "bf16_mixed"),
    "fsdp2_bf16_mixed_selective_op": _recipe("fsdp2", "bf16_mixed", "selective_op"),
    "fsdp2_bf16_mixed_full_ac": _recipe("fsdp2", "bf16_mixed", "full"),
    # workload.compile: every block compiled in place (inductor), measured for real on cpu
    "ddp_bf16_mixed_full_ac_compiled": {**_recipe("ddp", "bf16_mixed", "full"), "compile": True},
    "fsdp2_bf16_mixed_selective_op_compiled": {**_recipe("fsdp2", "bf16_mixed", "selective_op"),
                                               "compile": True},
    "deepspeed_zero3_fp32": _recipe("zero3", "fp32"),
    "deepspeed_zero3_bf16_mixed": _recipe("zero3", "bf16_mixed"),
    # DeepSpeed's offload_optimizer (device cpu): on a CPU host and device are one memory,
    # so the row checks the accounted total; the device / host split is the emulation's
    "deepspeed_zero3_offload_optimizer": {**_recipe("zero3", "fp32"),
                                          "zero3_offload_optimizer": "cpu"},
    "custom_fsdp2_bf16_mixed": {},
    # 2 x 2 meshes (workload.parallelism): FSDP2 on dp_shard beside tp, HSDP, cp
    "fsdp2_tp_sp_bf16_mixed": {**_recipe("fsdp2", "bf16_mixed"), "parallelism.tp": 2},
    "hsdp_bf16_mixed": {**_recipe("fsdp2", "bf16_mixed"), "parallelism.dp_replicate": 2},
    "fsdp2_cp_bf16_mixed": {**_recipe("fsdp2", "bf16_mixed"), "parallelism.cp": 2},
    # FSDP2's CPUOffloadPolicy: on a CPU host and device are one memory, so the row checks
    # the capture and the accounted total; the device / host split is tracefleet-predict's
    "fsdp2_cpu_offload_bf16_mixed": {**_recipe("fsdp2", "bf16_mixed"), "cpu_offload": True},
    # pp 2 stages x FSDP2 2: 2 micro-batches of batch_size per step
    "pp_1f1b_fsdp2_bf16_mixed": {**_recipe("fsdp2", "bf16_mixed"), "parallelism.pp": 2},
    "pp_gpipe_fsdp2_bf16_mixed": {**_recipe("fsdp2", "bf16_mixed"), "parallelism.pp": 2,
                                  "parallelism.pp_schedule": "gpipe"},
    # the same FSDP2 job at 4 and 8 ranks (fsdp2_bf16_mixed: 2): what shrinks with the world
    # (shards, their gradients and optimizer state, the update's temporaries) shrinks in both
    "fsdp2_bf16_mixed_world4": _recipe("fsdp2", "bf16_mixed"),
    "fsdp2_bf16_mixed_world8": _recipe("fsdp2", "bf16_mixed"),
    # pp 2 x tp 2, no FSDP (no dp rank left, as torchtitan), fp32 (torchtitan's mixed
    # precision is FSDP's): the last stage's cross-entropy on vocabulary-sharded logits (loss
    # parallel), each micro-batch's kept by the schedule; a large vocabulary, so they weigh
    "pp_tp_loss_parallel_fp32": {**_recipe("fsdp2", "fp32"), "parallelism.pp": 2,
                                 "parallelism.tp": 2, "vocab": 4096},
    # MoE blocks (4 experts, top 2) with expert parallel 2 over dp_shard 4 (efsdp 2); the
    # fixed router imposes the fake capture's routing assumption (balanced) on the real run
    "moe_ep_bf16_mixed": {**_recipe("fsdp2", "bf16_mixed"), "parallelism.ep": 2,
                          "moe_experts": 4, "moe_top_k": 2, "moe_ffn_dim": 512,
                          "moe_router": "fixed"},
    # experts split both ways (torchtitan's ep x etp): expert parallel 2 over dp_shard 2, each
    # expert's hidden units over tp 2; tokens exchanged within one tp index's ranks
    "moe_ep_etp_bf16_mixed": {**_recipe("fsdp2", "bf16_mixed"), "parallelism.ep": 2,
                              "parallelism.tp": 2, "moe_experts": 4, "moe_top_k": 2,
                              "moe_ffn_dim": 512, "moe_router": "fixed"},
    # the families and knobs of 2025-26 (issue 30): Qwen3's q/k norms and a head size that is
    # not d_model / n_heads (4 x 96 = 384 wide on 256), tied embeddings; a chunked loss; FSDP2
    # keeping every block gathered; Qwen3's MoE (renormalized top-k) under expert parallel
    "qwen3_fsdp2_bf16_mixed_tied": {**_recipe("fsdp2", "bf16_mixed", "selective_op"),
                                    "model": "qwen3", "head_dim": 96, "tie_embeddings": True},
    "qwen3_tp_sp_bf16_mixed": {**_recipe("fsdp2", "bf16_mixed"), "model": "qwen3",
                               "head_dim": 96, "parallelism.tp": 2},
    "qwen3_moe_ep_bf16_mixed": {**_recipe("fsdp2", "bf16_mixed", "full"), "model": "qwen3",
                                "head_dim": 96, "parallelism.ep": 2, "moe_experts": 4,
                                "moe_top_k": 2, "moe_ffn_dim": 256, "moe_router": "fixed"},
    # DeepSeek-V3's shape: multi-head latent attention (values narrower than q and k), a dense
    # first block, then routed + shared experts with sigmoid scores, expert parallel 2
    "deepseek_v3_mla_moe_ep_bf16_mixed": {
        **_recipe("fsdp2", "bf16_mixed", "full"), "model": "deepseek_v3", "head_dim": 64,
        "mla_kv_lora_rank": 128, "mla_rope_head_dim": 32, "mla_v_head_dim": 64,
        "parallelism.ep": 2, "moe_experts": 4, "moe_top_k": 2, "moe_ffn_dim": 256,
        "moe_shared_experts": 1, "moe_dense_layers": 1, "moe_score": "sigmoid",
        "moe_router": "fixed"},
    # ...under context parallel 2: ring attention on MLA's queries, keys and values. Values as
    # wide as q and k (64 + 32): narrower ones take CUDA's memory-efficient kernel on fake, but
    # the cpu's flash kernel needs them zero-padded, which the measured run then holds (0.92)
    "deepseek_v3_mla_cp_ep_bf16_mixed": {
        **_recipe("fsdp2", "bf16_mixed", "full"), "model": "deepseek_v3", "head_dim": 64,
        "mla_kv_lora_rank": 128, "mla_rope_head_dim": 32, "mla_v_head_dim": 96,
        "parallelism.cp": 2, "parallelism.ep": 2, "moe_experts": 4, "moe_top_k": 2,
        "moe_ffn_dim": 256, "moe_shared_experts": 1, "moe_dense_layers": 1,
        "moe_score": "sigmoid", "moe_router": "fixed"},
    # DeepSeek-V3's shape under tp 2: MLA's latent projections whole on each rank, its heads
    # split; the MoE blocks' experts split by hidden unit (expert tensor parallel)
    "deepseek_v3_mla_tp_etp_bf16_mixed": {
        **_recipe("fsdp2", "bf16_mixed", "full"), "model": "deepseek_v3", "head_dim": 64,
        "mla_kv_lora_rank": 128, "mla_q_lora_rank": 96, "mla_rope_head_dim": 32,
        "mla_v_head_dim": 64, "parallelism.tp": 2, "moe_experts": 4, "moe_top_k": 2,
        "moe_ffn_dim": 256, "moe_shared_experts": 1, "moe_dense_layers": 1,
        "moe_score": "sigmoid", "moe_router": "fixed"},
    # Llama 4's shape: MoE every 2nd block (top-1 sigmoid, a shared expert), chunked attention
    # in the rotary blocks, NoPE every 2nd; tp 2 with the experts' hidden units split (expert
    # tensor parallel) over dp_shard 2
    "llama4_moe_tp_etp_bf16_mixed": {
        **_recipe("fsdp2", "bf16_mixed", "full"), "model": "llama4", "parallelism.tp": 2,
        "moe_experts": 4, "moe_top_k": 1, "moe_ffn_dim": 256, "moe_shared_experts": 1,
        "moe_every": 2, "moe_score": "sigmoid", "attention_chunk": 64, "nope_every": 2,
        "moe_router": "fixed"},
    "fsdp2_chunked_loss_bf16_mixed": {**_recipe("fsdp2", "bf16_mixed"), "loss_chunks": 4,
                                      "vocab": 8192},
    "fsdp2_reshard_never_bf16_mixed": {**_recipe("fsdp2", "bf16_mixed"),
                                       "reshard_after_forward": "never"},
    # each parameter's AdamW step in backward, its gradient freed right after (torchtitan's
    # optimizer.early_step_in_backward); a short batch, so the plain step's peak is the update's
    "fsdp2_optimizer_in_backward_bf16_mixed": {**_recipe("fsdp2", "bf16_mixed"),
                                               "optimizer_in_backward": True, "batch_size": 1,
                                               "seq_len": 32},
    "fsdp2_short_batch_bf16_mixed": {**_recipe("fsdp2", "bf16_mixed"), "batch_size": 1,
                                     "seq_len": 32},
    # torchao's low-bit AdamW: its quantized state, held all step (its compiled update's
    # buffers are inductor's, planned on fake as on the cpu)
    "fsdp2_adamw_8bit_bf16_mixed": {**_recipe("fsdp2", "bf16_mixed"), "optimizer": "adamw_8bit"},
    "fsdp2_adamw_4bit_bf16_mixed": {**_recipe("fsdp2", "bf16_mixed"), "optimizer": "adamw_4bit"},
    # ...each pipeline stage's parameters stepped by it (pp 2 x FSDP2 2)
    "pp_1f1b_fsdp2_adamw_8bit_bf16_mixed": {**_recipe("fsdp2", "bf16_mixed"), "parallelism.pp": 2,
                                            "optimizer": "adamw_8bit"},
    # activations offloaded to the host (save_on_cpu's hooks): on the cpu host and device are
    # one memory, so the row checks the trace's copies and their lifetimes against the
    # measured total; tracefleet-predict splits the host's off by category
    "fsdp2_activation_offload_bf16_mixed": {**_recipe("fsdp2", "bf16_mixed"),
                                            "activation_offload": True},
    **ECOSYSTEM,
}
# rows run at another world size than WORLD
WORLDS = {"fsdp2_tp_sp_bf16_mixed": 4, "hsdp_bf16_mixed": 4, "fsdp2_cp_bf16_mixed": 4,
          "pp_1f1b_fsdp2_bf16_mixed": 4, "pp_gpipe_fsdp2_bf16_mixed": 4, "moe_ep_bf16_mixed": 4,
          "moe_ep_etp_bf16_mixed": 4, "pp_1f1b_fsdp2_adamw_8bit_bf16_mixed": 4,
          "pp_tp_loss_parallel_fp32": 4, "fsdp2_bf16_mixed_world4": 4,
          "fsdp2_bf16_mixed_world8": 8,
          "qwen3_tp_sp_bf16_mixed": 4, "qwen3_moe_ep_bf16_mixed": 4,
          "deepseek_v3_mla_moe_ep_bf16_mixed": 4, "llama4_moe_tp_etp_bf16_mixed": 4,
          "deepseek_v3_mla_tp_etp_bf16_mixed": 4, "deepseek_v3_mla_cp_ep_bf16_mixed": 4}
# DeepSpeed's rows: the plain capture the emulation partitions (DeepSpeed's bf16 mode runs the
# model in bf16: a pure-bf16 plain trace; its fp32 masters and moments are the layout's).
_PLAIN = {"deepspeed_zero3_fp32": _recipe("local", "fp32"),
          "deepspeed_zero3_bf16_mixed": _recipe("local", "bf16"),
          "deepspeed_zero3_offload_optimizer": _recipe("local", "fp32")}


def _overrides(workload: dict) -> list[str]:
    return [f"workload.{k}={v}" for k, v in workload.items()]


def _capture(workload: dict, device: str, out: Path, env: dict, world: int = WORLD) -> dict:
    """``tracefleet-capture`` into ``out``; its meta.json (a capture already in ``out``, from
    ``--keep`` of an earlier run, is reused)."""
    if RunDir(out).meta.is_file():
        return json.loads(RunDir(out).meta.read_text())
    cmd = [sys.executable, "-m", "orchestrator.cli.capture", *_overrides(workload),
           f"workload.device={device}", f"world_size={world}", f"out_dir={out}",
           "warmup_iters=2", "timing_iters=1", f"hydra.run.dir={out}.hydra",
           "hydra.output_subdir=null",
           # memory is measured, not speed: a loaded machine's slow actor start is no failure
           "cluster.timeout_s=600"]
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **env, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"capture failed ({' '.join(cmd[3:])}):\n{proc.stderr[-3000:]}")
    return json.loads(RunDir(out).meta.read_text())


def _predict(folder: Path, zero3: Zero3Config | None, world: int = WORLD) -> tuple[int, dict]:
    """Max accounted peak over the folder's distinct rank traces (faithful dry run on meta)
    and that rank's breakdown."""
    best = (0, {})
    seen = set()
    for rank in range(world):
        path = folder / trace_file_name(rank)
        data = path.read_bytes()
        if data in seen:  # fake and meta record rank 0 once for every rank
            continue
        seen.add(data)
        report = replay_rank(path, ReplayConfig(
            mode="compute", device="meta", iters=1, warmup_iters=1, measure_memory=False,
            allocation=AllocationConfig(mode="faithful")),
            extensions=lambda trace: zero3_extensions(zero3, trace))
        if report["status"] != "ok":
            raise SystemExit(f"dry run of {path} ended {report['status']}: {report['error']}")
        if report["accounted_peak_bytes"] > best[0]:
            best = (report["accounted_peak_bytes"], report["peak_breakdown"])
    return best


def _optimizer_of(step):
    """The optimizer a step uses: ``step.optimizer`` (the recipes), else the one its closure
    holds (a user's ``opt``), else None (the optimizer in backward has one per parameter)."""
    import torch

    # one torch.optim.Optimizer (the tracker hooks its step); not the step in backward's many
    found = getattr(step, "optimizer", None)
    step = getattr(step, "__wrapped__", step)  # the capture names a user's step's errors
    cells = [c.cell_contents for c in (getattr(step, "__closure__", None) or ())]
    return next((c for c in (found, *cells) if isinstance(c, torch.optim.Optimizer)), None)


def _tracker_rank(workload: dict, env: dict, out: str) -> None:
    """PyTorch's FSDPMemTracker over one step of ``workload`` on fake (rank 0), after a warm-up."""
    os.environ.update(env)
    import torch.distributed as dist
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from actors.capture.fake_rank import _shapes_only
    from actors.capture.workloads.build import WorkloadConfig, build_workload

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    cfg = WorkloadConfig(**workload, device="fake")
    with _shapes_only("fake", WORLD) as (device, mesh, _):
        wl = build_workload(cfg, 0, WORLD, device, mesh)
        wl.step(wl.next_batch())
        optimizer = _optimizer_of(wl.step)
        if optimizer is None:  # without the optimizer the tracker would miss its state
            Path(out).write_text("")
            dist.destroy_process_group()
            return
        tracker = FSDPMemTracker(wl.model, optimizer)
        batch = wl.next_batch()
        tracker.track_inputs(batch)
        with tracker:
            wl.step(batch)
        peak = max(v["Total"] for v in tracker.get_tracker_snapshot("peak").values())
    Path(out).write_text(str(peak))
    dist.destroy_process_group()


def _fsdp_mem_tracker(workload: dict, env: dict, tmp: Path) -> int | None:
    out = tmp / "tracker.txt"
    proc = mp.get_context("spawn").Process(target=_tracker_rank, args=(workload, env, str(out)))
    proc.start()
    proc.join(900)
    if proc.is_alive():
        proc.kill()
    text = out.read_text().strip() if out.is_file() else ""
    out.unlink(missing_ok=True)  # never read a stale figure
    return int(text) if text else None


# --quick: one row of each way a row is predicted, on the tiny model or the steps' own tiny
# defaults: DeepSpeed through the ZeRO-3 emulation, a user's step (with FSDPMemTracker beside
# it), a built-in recipe on a 2 x 2 mesh at world 4 (each row is two captures, ~25 s: a plain
# built-in recipe's row would only repeat the mesh row's path)
QUICK_CONFIGS = ["deepspeed_zero3_fp32", "nn_transformer_encoder_fsdp2_checkpoint",
                 "fsdp2_tp_sp_bf16_mixed"]
# the keys of the JSON line (scripts/json_layout.py)
KEYS = {"configs": {EACH: dict.fromkeys(("predicted", "measured", "ratio", "breakdown",
                                         "seconds", "world_size", "fsdp_mem_tracker_ratio"))},
        **dict.fromkeys(("world_size", "model", "max_abs_error", "target", "all_within_target"))}


def run_config(name: str, model: dict, tmp: Path) -> dict:
    """One configuration's measured and predicted peaks."""
    custom = name.startswith("custom") or name in ECOSYSTEM
    if name in ECOSYSTEM:
        row = (ECOSYSTEM if model is MODEL else ECOSYSTEM_TINY)[name]
        workload, env = dict(model="custom", entrypoint=row["entrypoint"]), row["env"]
    else:
        workload = dict(CUSTOM) if custom else {**model, **CONFIGS[name]}
        env = EXAMPLE_ENV if custom and model is MODEL else {}
    world = WORLDS.get(name, WORLD)
    t0 = time.perf_counter()
    meta = _capture(workload, "cpu", tmp / f"{name}-real", env, world)
    measured = max(r["peak_memory_bytes"] for r in meta["ranks"])
    plain = _PLAIN.get(name)
    zero3 = None
    if plain is not None:  # DeepSpeed cannot run on fake: its emulation, with DeepSpeed's knobs
        workload = {**model, **plain}
        ds = meta["ds_config"]["zero_optimization"]
        zero3 = Zero3Config(strategy="per_module", world_size=WORLD, layout="deepspeed",
                            param_persistence_threshold=ds["stage3_param_persistence_threshold"],
                            reduce_bucket_size=ds["reduce_bucket_size"],
                            offload_optimizer=ds.get("offload_optimizer", {}),
                            offload_param=ds.get("offload_param", {}))
    _capture(workload, "fake", tmp / f"{name}-fake", env, world)
    predicted, breakdown = _predict(tmp / f"{name}-fake", zero3, world)
    row = {"predicted": predicted, "measured": measured,
           "ratio": round(predicted / measured, 4), "breakdown": breakdown,
           "seconds": round(time.perf_counter() - t0, 1)}
    row["world_size"], row["fsdp_mem_tracker_ratio"] = world, None
    # FSDPMemTracker runs FSDP2 over a 1-D mesh of WORLD ranks: not the mesh rows
    if (workload.get("parallel") == "fsdp2" or custom and "fsdp2" in name) and name not in WORLDS:
        tracked = _fsdp_mem_tracker(workload, env, tmp)
        row["fsdp_mem_tracker_ratio"] = round(tracked / measured, 4) if tracked else None
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="*", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--quick", action="store_true",
                        help="one tiny row of each kind (QUICK_CONFIGS): minutes, for the smoke "
                             "test")
    parser.add_argument("--keep", help="keep the captures in this folder (and reuse those "
                        "already there: re-predicts without re-capturing)")
    args = parser.parse_args()
    names, model = (QUICK_CONFIGS, TINY) if args.quick else (args.configs, MODEL)
    tmp = Path(args.keep or tempfile.mkdtemp(prefix="bench_predict_"))
    tmp.mkdir(parents=True, exist_ok=True)
    configs = {}
    for name in names:
        configs[name] = run_config(name, model, tmp)
        print(f"{name}: {json.dumps(configs[name])}", file=sys.stderr, flush=True)
    errors = [abs(c["ratio"] - 1) for c in configs.values()]
    emit({"configs": configs, "world_size": WORLD, "model": model,
          "max_abs_error": round(max(errors), 4), "target": TARGET,
          "all_within_target": all(TARGET[0] <= c["ratio"] <= TARGET[1]
                                   for c in configs.values())}, KEYS)


if __name__ == "__main__":
    main()
