"""Training under DeepSpeed ZeRO-3 on the ranks' existing torch.distributed group."""
from __future__ import annotations

import logging
import os
import warnings

import torch.nn as nn

log = logging.getLogger(__name__)


def zero3_step(model: nn.Module, cfg, leaf_class: type | None):
    """``(step(batch), info)``: one DeepSpeed ZeRO-3 iteration (every micro-batch's forward
    and backward, the optimizer step at the accumulation boundary).

    ``cfg`` is the WorkloadConfig; ``leaf_class`` the block class marked a ZeRO-3 leaf when
    ``cfg.leaf_modules`` (one coalesced fetch per block instead of one per module).
    ``bf16_mixed`` is DeepSpeed's bf16 mode: the engine casts the model to bf16 and keeps
    float32 master partitions and AdamW state in its optimizer. DeepSpeed reduce-scatters
    gradients after every micro-batch's backward (ZeRO-3 has no no_sync).
    """
    # DeepSpeed picks its accelerator at import: CPU unless the user chose otherwise.
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if cfg.device == "cuda" else "cpu")
    import deepspeed

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    # DeepSpeed calls the tensor collectives torch renamed; one warning per rank is noise.
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated",
                            category=FutureWarning)
    shm_status = prepare_shm_comm_op(cfg.build_shm_op)
    if cfg.leaf_modules and leaf_class is not None:
        deepspeed.utils.set_z3_leaf_modules(model, [leaf_class])
    offload = _offload_sections(cfg)
    ds_config = {
        "train_micro_batch_size_per_gpu": cfg.batch_size,
        "gradient_accumulation_steps": cfg.grad_accum_steps,
        "optimizer": {"type": "AdamW", "params": {"lr": cfg.lr, "torch_adam": True}},
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": cfg.zero3_param_persistence_threshold,
            "stage3_prefetch_bucket_size": cfg.zero3_prefetch_bucket_size,
            "stage3_max_reuse_distance": cfg.zero3_max_reuse_distance,
            "reduce_bucket_size": cfg.zero3_reduce_bucket_size,
            **offload,
        },
        # offloaded, DeepSpeed would insist on DeepSpeedCPUAdam (a C++ op built on first use)
        **({"zero_force_ds_cpu_optimizer": False} if offload else {}),
        "fp16": {"enabled": False},
        "bf16": {"enabled": cfg.precision == "bf16_mixed"},
        "steps_per_print": 2**31 - 1,  # keep DeepSpeed's per-step log quiet
    }
    # torch.distributed is already up: DeepSpeed adopts the existing default group.
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=ds_config, dist_init_required=False)

    def step(batch):
        for micro_batch in batch:  # DeepSpeed scales the loss by the accumulation steps
            engine.backward(engine(*micro_batch))
            engine.step()  # the optimizer steps at the boundary only

    step.engine = engine  # DeepSpeed's own buffers, for tests that count them
    return step, {"deepspeed_version": deepspeed.__version__, "ds_config": ds_config,
                  "shm_comm_op": shm_status}


def _offload_sections(cfg) -> dict:
    """DeepSpeed's ``offload_optimizer`` / ``offload_param`` for workload.zero3_offload_*."""
    return {f"offload_{part}": {"device": str(device)} for part, device in (
        ("optimizer", cfg.zero3_offload_optimizer), ("param", cfg.zero3_offload_param))
        if str(device) != "none"}


def prepare_shm_comm_op(build: bool) -> str:
    """Build DeepSpeed's CPU shm comm op, or make DeepSpeed skip it; returns what happened.

    DeepSpeed's torch backend JIT-compiles this op when it starts (30-90 s with g++ the
    first time) and raises if the build fails. It only speeds up intra-node inference
    all-reduces, so training works without it: marking it incompatible in
    ``deepspeed.ops.__compatible_ops__`` (a cached dict DeepSpeed consults) skips it.
    """
    os.environ.setdefault("TORCH_EXTENSIONS_DIR",
                          os.path.expanduser("~/.cache/tracefleet/torch_extensions"))
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None:
        return "not offered by the accelerator"
    compatible = deepspeed.ops.__compatible_ops__
    if not compatible.get(builder.NAME, False):
        return "skipped: incompatible"
    if not build:
        compatible[builder.NAME] = False
        return "skipped: workload.build_shm_op=false"
    try:
        builder.load(verbose=False)
    except Exception as exc:  # a missing or failing compiler: fall back to plain gloo
        compatible[builder.NAME] = False
        log.warning("DeepSpeed shm comm op build failed (%s); continuing without it", exc)
        return f"skipped: build failed ({type(exc).__name__})"
    return "built"
