"""Capture workloads: a small GPT-style decoder trained data parallel or under ZeRO-3.

``build_workload`` returns a :class:`Workload`: the model (whose submodules get the
module ranges), a batch source and a ``step(batch)`` running one full training
iteration (forward, backward, gradient communication, optimizer step).
"""
from __future__ import annotations

import logging
import os
import warnings
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from actors.errors import ConfigError

log = logging.getLogger(__name__)

KINDS = ("gpt_dp", "gpt_zero3")


@dataclass
class WorkloadConfig:
    """What to train while capturing."""

    # gpt_dp (plain data parallel over gloo) or gpt_zero3 (DeepSpeed ZeRO-3).
    kind: str = "gpt_dp"
    # Vocabulary size (token embedding rows, LM head outputs).
    vocab: int = 512
    # Hidden size.
    d_model: int = 128
    # Number of decoder blocks.
    n_layers: int = 2
    # Attention heads per block (must divide d_model).
    n_heads: int = 4
    # Tokens per sample (also the number of learned positions).
    seq_len: int = 64
    # Samples per rank per iteration (DeepSpeed's train_micro_batch_size_per_gpu).
    batch_size: int = 4
    # AdamW learning rate.
    lr: float = 1e-3
    # Model init seed, the same on every rank; rank r draws its batches from seed + 1 + r.
    seed: int = 0
    # gpt_dp: 0 = one all-reduce per gradient; > 0 = gradients packed (in backward order)
    # into flat buckets of at most this many elements, one all-reduce each (like DDP).
    dp_bucket_numel: int = 0
    # gpt_zero3: mark each decoder Block a ZeRO-3 leaf module (one fetch per block).
    leaf_modules: bool = False
    # gpt_zero3: parameters with fewer elements stay gathered (stage3_param_persistence_threshold).
    zero3_param_persistence_threshold: int = 0
    # gpt_zero3: elements fetched ahead of use; 0 fetches each module when it runs.
    zero3_prefetch_bucket_size: int = 0
    # gpt_zero3: keep parameters gathered when reused within this many elements; 0 releases
    # them after every use, so backward fetches them again.
    zero3_max_reuse_distance: int = 0
    # gpt_zero3: gradient elements per reduce-scatter bucket (reduce_bucket_size).
    zero3_reduce_bucket_size: int = 200_000
    # gpt_zero3: let DeepSpeed JIT-build its CPU shm comm op (30-90 s with g++ the first time;
    # skipped if the build fails). Off by default: only DeepSpeed's inference all-reduce uses
    # it, so a training trace is the same without it.
    build_shm_op: bool = False


def validate(cfg: WorkloadConfig) -> None:
    """Raise ConfigError when the workload knobs are inconsistent."""
    if cfg.kind not in KINDS:
        raise ConfigError(f"workload.kind={cfg.kind!r}: expected one of {', '.join(KINDS)}")
    if cfg.dp_bucket_numel < 0:
        raise ConfigError(f"workload.dp_bucket_numel={cfg.dp_bucket_numel}: must be >= 0")
    for name in ("vocab", "d_model", "n_layers", "n_heads", "seq_len", "batch_size"):
        if getattr(cfg, name) < 1:
            raise ConfigError(f"workload.{name}={getattr(cfg, name)}: must be >= 1")
    if cfg.d_model % cfg.n_heads:
        raise ConfigError(f"workload.d_model={cfg.d_model} is not divisible by "
                          f"workload.n_heads={cfg.n_heads}")


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, c // self.n_heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class MLP(nn.Module):
    def __init__(self, d_model: int):
        super().__init__()
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.proj = nn.Linear(4 * d_model, d_model)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """One pre-norm decoder block: the unit ZeRO-3 leaf mode fetches at once."""

    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Token + learned position embedding, decoder blocks, final norm, LM head."""

    def __init__(self, cfg: WorkloadConfig):
        super().__init__()
        self.tok_emb = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg.d_model, cfg.n_heads) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)

    def forward(self, idx, targets):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


@dataclass
class Workload:
    """A built workload on one rank."""

    model: nn.Module  # the plain model (DeepSpeed's engine wraps it; hooks go here)
    step: Callable[[tuple], None]  # one training iteration on a batch
    next_batch: Callable[[], tuple]  # (idx, targets), drawn from the rank's own generator
    num_params: int  # parameters of the full (unpartitioned) model
    info: dict  # extra facts for meta.json (e.g. the DeepSpeed version)


def build_workload(cfg: WorkloadConfig, rank: int, world_size: int) -> Workload:
    """Build the model, optimizer and data source; torch.distributed must be initialized."""
    validate(cfg)
    torch.manual_seed(cfg.seed)  # identical initial weights on every rank
    model = GPT(cfg)
    num_params = sum(p.numel() for p in model.parameters())
    gen = torch.Generator().manual_seed(cfg.seed + 1 + rank)

    def next_batch():
        seq = torch.randint(0, cfg.vocab, (cfg.batch_size, cfg.seq_len + 1), generator=gen)
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()

    if cfg.kind == "gpt_dp":
        step, info = _data_parallel_step(model, cfg, world_size), {}
    else:
        step, info = _zero3_step(model, cfg)
    return Workload(model=model, step=step, next_batch=next_batch, num_params=num_params,
                    info=info)


def _data_parallel_step(model: nn.Module, cfg: WorkloadConfig, world_size: int):
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr)
    buckets = _buckets(params[::-1], cfg.dp_bucket_numel)  # DDP fills buckets in backward order

    def step(batch):
        opt.zero_grad(set_to_none=True)
        model(*batch).backward()
        for bucket in buckets:
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


def _zero3_step(model: nn.Module, cfg: WorkloadConfig):
    # DeepSpeed picks its accelerator at import: CPU unless the user chose otherwise.
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    # DeepSpeed calls the tensor collectives torch renamed; one warning per rank is noise.
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated",
                            category=FutureWarning)
    shm_status = prepare_shm_comm_op(cfg.build_shm_op)
    if cfg.leaf_modules:
        deepspeed.utils.set_z3_leaf_modules(model, [Block])
    ds_config = {
        "train_micro_batch_size_per_gpu": cfg.batch_size,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": cfg.lr, "torch_adam": True}},
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": cfg.zero3_param_persistence_threshold,
            "stage3_prefetch_bucket_size": cfg.zero3_prefetch_bucket_size,
            "stage3_max_reuse_distance": cfg.zero3_max_reuse_distance,
            "reduce_bucket_size": cfg.zero3_reduce_bucket_size,
        },
        "fp16": {"enabled": False},
        "bf16": {"enabled": False},
        "steps_per_print": 2**31 - 1,  # keep DeepSpeed's per-step log quiet
    }
    # torch.distributed is already up (gloo): DeepSpeed adopts the existing default group.
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=ds_config, dist_init_required=False)

    def step(batch):
        loss = engine(*batch)
        engine.backward(loss)
        engine.step()

    return step, {"deepspeed_version": deepspeed.__version__, "ds_config": ds_config,
                  "shm_comm_op": shm_status}


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

