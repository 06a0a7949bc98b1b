"""Capture workloads: a GPT-style or Llama-style decoder, trained data parallel, under
DeepSpeed ZeRO-3, or locally (no gradient communication), on cpu, cuda or meta.

``build_workload`` returns a :class:`Workload`: the model (whose submodules get the module
ranges), a batch source and a ``step(batch)`` running one full training iteration
(forward, backward, gradient communication, optimizer step).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from actors.capture.gpt import GPT, Block
from actors.capture.llama import Attention, Llama, TransformerBlock
from actors.choices import Choice
from actors.errors import ConfigError


class WorkloadKind(Choice):
    """Model and parallelism: ``<model>_<how gradients are combined>``."""

    gpt_dp = "gpt_dp"  # data parallel: gradients all-reduced in buckets
    gpt_zero3 = "gpt_zero3"  # DeepSpeed ZeRO-3 (cpu or cuda)
    gpt_local = "gpt_local"  # every rank trains alone: no collectives
    llama_dp = "llama_dp"
    llama_zero3 = "llama_zero3"
    llama_local = "llama_local"  # plain traces, e.g. for the ZeRO-3 emulation's world size
    custom = "custom"  # the user's own step, workload.entrypoint (actors/capture/custom.py)


class WorkloadDevice(Choice):
    """Where the model lives while capturing."""

    cpu = "cpu"
    cuda = "cuda"  # one GPU per rank (LOCAL_RANK), NCCL
    meta = "meta"  # shapes only: no data, no memory, fake process group (any world size)
    fake = "fake"  # like meta, but tensors report cpu (FakeTensorMode): FSDP2 runs too


class DType(Choice):
    """Parameter and activation dtype."""

    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


@dataclass
class WorkloadConfig:
    """What to train while capturing."""

    kind: WorkloadKind = WorkloadKind.gpt_dp
    # cpu, cuda (one GPU per rank), meta (shapes only; 70B-class models in seconds) or fake
    # (shapes only on fake cpu tensors, any world size; see actors/capture/fake_mode.py).
    device: WorkloadDevice = WorkloadDevice.cpu
    # kind=custom: the user's step, PATH.py:FUNCTION or package.module:FUNCTION, whose
    # build(ctx) returns (model, make_batch, step) (see actors/capture/custom.py). The
    # model knobs below do not apply to it.
    entrypoint: str = ""
    # Parameter and activation dtype (ZeRO-3 kinds: float32 only).
    dtype: DType = DType.float32
    # Vocabulary size (token embedding rows, LM head outputs).
    vocab: int = 512
    # Hidden size.
    d_model: int = 128
    # Number of decoder blocks.
    n_layers: int = 2
    # Attention heads per block (must divide d_model).
    n_heads: int = 4
    # llama: key/value heads (grouped-query attention; must divide n_heads); 0 = n_heads.
    n_kv_heads: int = 0
    # Hidden size of the feed-forward block; 0 = the model's rule (gpt: 4 x d_model; llama:
    # 2/3 of 4 x d_model rounded up to a multiple of 256, as Meta's reference).
    ffn_dim: int = 0
    # Tokens per sample (gpt: also the number of learned positions).
    seq_len: int = 64
    # Samples per rank per iteration (DeepSpeed's train_micro_batch_size_per_gpu).
    batch_size: int = 4
    # llama: fused (flash kernel, nothing seq x seq kept) or math (explicit softmax).
    attention: Attention = Attention.fused
    # llama: rotary embedding base.
    rope_theta: float = 500000.0
    # llama: RMSNorm epsilon.
    norm_eps: float = 1e-5
    # AdamW learning rate.
    lr: float = 1e-3
    # Model init seed, the same on every rank; rank r draws its batches from seed + 1 + r.
    seed: int = 0
    # *_dp: 0 = one all-reduce per gradient; > 0 = gradients packed (in backward order)
    # into flat buckets of at most this many elements, one all-reduce each (like DDP).
    dp_bucket_numel: int = 0
    # *_zero3: mark each decoder block a ZeRO-3 leaf module (one fetch per block).
    leaf_modules: bool = False
    # *_zero3: parameters with fewer elements stay gathered (stage3_param_persistence_threshold).
    zero3_param_persistence_threshold: int = 0
    # *_zero3: elements fetched ahead of use; 0 fetches each module when it runs.
    zero3_prefetch_bucket_size: int = 0
    # *_zero3: keep parameters gathered when reused within this many elements; 0 releases
    # them after every use, so backward fetches them again.
    zero3_max_reuse_distance: int = 0
    # *_zero3: gradient elements per reduce-scatter bucket (reduce_bucket_size).
    zero3_reduce_bucket_size: int = 200_000
    # *_zero3: let DeepSpeed JIT-build its CPU shm comm op (30-90 s with g++ the first time;
    # skipped if the build fails). Off by default: only DeepSpeed's inference all-reduce uses
    # it, so a training trace is the same without it.
    build_shm_op: bool = False

    def __post_init__(self):
        self.kind = WorkloadKind.coerce(self.kind, "workload.kind")
        self.device = WorkloadDevice.coerce(self.device, "workload.device")
        self.dtype = DType.coerce(self.dtype, "workload.dtype")
        self.attention = Attention.coerce(self.attention, "workload.attention")

    @property
    def model(self) -> str:
        """``gpt``, ``llama`` or ``custom``."""
        return self.kind.value.split("_")[0]

    @property
    def parallel(self) -> str:
        """``dp``, ``zero3``, ``local`` or ``custom`` (whatever the user's step does)."""
        return self.kind.value.split("_")[-1]


def validate(cfg: WorkloadConfig) -> None:
    """Raise ConfigError when the workload knobs are inconsistent."""
    if cfg.kind == WorkloadKind.custom:
        if not cfg.entrypoint:
            raise ConfigError("workload.kind=custom needs workload.entrypoint=PATH.py:FUNCTION "
                              "(or package.module:FUNCTION)")
        if cfg.device == WorkloadDevice.meta:
            raise ConfigError("workload.kind=custom on workload.device=meta: FSDP2 and DDP "
                              "refuse meta tensors; use workload.device=fake (shapes only too)")
        return
    if cfg.entrypoint:
        raise ConfigError(f"workload.entrypoint={cfg.entrypoint!r} is only read with "
                          f"workload.kind=custom (got workload.kind={cfg.kind}); use "
                          "workload=custom")
    for name in ("vocab", "d_model", "n_layers", "n_heads", "seq_len", "batch_size"):
        if getattr(cfg, name) < 1:
            raise ConfigError(f"workload.{name}={getattr(cfg, name)}: must be >= 1")
    for name in ("dp_bucket_numel", "n_kv_heads", "ffn_dim"):
        if getattr(cfg, name) < 0:
            raise ConfigError(f"workload.{name}={getattr(cfg, name)}: must be >= 0")
    if cfg.d_model % cfg.n_heads:
        raise ConfigError(f"workload.d_model={cfg.d_model} is not divisible by "
                          f"workload.n_heads={cfg.n_heads}")
    if cfg.model == "gpt" and cfg.n_kv_heads not in (0, cfg.n_heads):
        raise ConfigError(f"workload.n_kv_heads={cfg.n_kv_heads}: grouped-query attention is "
                          f"a llama knob; workload.kind={cfg.kind} needs 0")
    if cfg.model == "llama":
        if cfg.n_heads % (cfg.n_kv_heads or cfg.n_heads):
            raise ConfigError(f"workload.n_heads={cfg.n_heads} is not divisible by "
                              f"workload.n_kv_heads={cfg.n_kv_heads}")
        if (cfg.d_model // cfg.n_heads) % 2:
            raise ConfigError(f"workload.d_model / workload.n_heads = {cfg.d_model // cfg.n_heads}"
                              ": rotary embeddings need an even head size")
    if cfg.parallel == "zero3":
        if cfg.device in (WorkloadDevice.meta, WorkloadDevice.fake):
            raise ConfigError(f"workload.kind={cfg.kind} runs DeepSpeed, which needs real "
                              f"tensors; on workload.device={cfg.device} use a *_local kind "
                              "(plain traces for the ZeRO-3 emulation) or *_dp")
        if cfg.dtype != DType.float32:
            raise ConfigError(f"workload.kind={cfg.kind} captures in float32 only "
                              f"(got workload.dtype={cfg.dtype})")


def ffn_dim_of(cfg: WorkloadConfig) -> int:
    """The feed-forward hidden size ``cfg`` asks for (see WorkloadConfig.ffn_dim)."""
    if cfg.ffn_dim:
        return cfg.ffn_dim
    if cfg.model == "gpt":
        return 4 * cfg.d_model
    return -(-int(2 * 4 * cfg.d_model / 3) // 256) * 256


def build_model(cfg: WorkloadConfig) -> tuple[nn.Module, type]:
    """``(model, block class)`` on the current default device (``with torch.device(...)``)."""
    if cfg.model == "gpt":
        model = GPT(cfg.vocab, cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.seq_len, ffn_dim_of(cfg))
        return model, Block
    model = Llama(cfg.vocab, cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads or cfg.n_heads,
                  ffn_dim_of(cfg), cfg.seq_len, cfg.rope_theta, cfg.norm_eps, cfg.attention)
    return model, TransformerBlock


@dataclass
class Workload:
    """A built workload on one rank."""

    model: nn.Module  # the plain model (DeepSpeed's engine wraps it; hooks go here)
    step: Callable[[tuple], None]  # one training iteration on a batch
    next_batch: Callable[[], tuple]  # (idx, targets), drawn from the rank's own generator
    num_params: int  # parameters of the full (unpartitioned) model
    info: dict  # extra facts for meta.json (e.g. the DeepSpeed version)


def build_workload(cfg: WorkloadConfig, rank: int, world_size: int,
                   device: torch.device | None = None, mesh=None) -> Workload:
    """Build the model, optimizer and data source on ``device`` (default: cfg.device; fake:
    cpu, called inside the fake tensor mode); torch.distributed must be initialized unless
    the kind is ``*_local``. ``mesh``: the 1-D DeviceMesh over all ranks (kind=custom)."""
    validate(cfg)
    device = device or torch.device("cpu" if cfg.device == "fake" else str(cfg.device))
    if cfg.kind == WorkloadKind.custom:
        from actors.capture.context import CaptureContext
        from actors.capture.custom import build_custom

        assert mesh is not None, "the caller creates the mesh (fake: before the fake mode)"
        return build_custom(cfg.entrypoint, CaptureContext(device, rank, world_size, mesh))
    torch.manual_seed(cfg.seed)  # identical initial weights on every rank
    with torch.device(device):
        model, block_class = build_model(cfg)
    model = model.to(getattr(torch, str(cfg.dtype)))
    num_params = sum(p.numel() for p in model.parameters())
    gen = torch.Generator().manual_seed(cfg.seed + 1 + rank)

    def next_batch():
        if device.type == "meta":  # no values to draw
            idx = torch.empty(cfg.batch_size, cfg.seq_len, dtype=torch.long, device=device)
            return idx, torch.empty_like(idx)
        seq = torch.randint(0, cfg.vocab, (cfg.batch_size, cfg.seq_len + 1), generator=gen)
        return seq[:, :-1].contiguous().to(device), seq[:, 1:].contiguous().to(device)

    if cfg.parallel == "zero3":
        from actors.capture.zero3 import zero3_step

        step, info = zero3_step(model, cfg, block_class)
    else:
        step, info = _optimizer_step(model, cfg, world_size if cfg.parallel == "dp" else 0), {}
    return Workload(model=model, step=step, next_batch=next_batch, num_params=num_params,
                    info=info)


def _optimizer_step(model: nn.Module, cfg: WorkloadConfig, world_size: int):
    """Forward, backward, gradient all-reduce over ``world_size`` ranks (0: none), AdamW."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr)
    buckets = _buckets(params[::-1], cfg.dp_bucket_numel) if world_size else []

    def step(batch):
        opt.zero_grad(set_to_none=True)
        model(*batch).backward()
        for bucket in buckets:  # DDP fills buckets in backward order
            grads = [p.grad for p in bucket]
            if len(grads) == 1:
                dist.all_reduce(grads[0])
                grads[0].div_(world_size)
                continue
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat)
            flat.div_(world_size)
            for g, chunk in zip(grads, flat.split([g.numel() for g in grads])):
                g.copy_(chunk.view_as(g))
        opt.step()

    return step


def _buckets(params: list, bucket_numel: int) -> list[list]:
    """Consecutive groups of params of at most bucket_numel elements (0: one param each)."""
    buckets, size = [], 0
    for p in params:
        if not buckets or bucket_numel <= 0 or size + p.numel() > bucket_numel:
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += p.numel()
    return buckets
