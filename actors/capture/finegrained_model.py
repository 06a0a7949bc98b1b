"""A fine-grained model for ZeRO-3 studies, and a data-parallel capture of it.

A stem Linear, blocks of several small Linear layers, then an MoE-style block (a gate and ``num_experts``
two-layer experts, every expert applied to every token and mixed by the gate's softmax, so
each expert runs on every rank in every step), then a head: many small modules, the case
where ZeRO-3 pays a host cost per parameter. Its natural ZeRO-3 leaves are the Linear
stacks and the MoE block (``LEAF_PATTERNS``, ``leaf_classes()``). The stem keeps every leaf's
input a tensor that needs a gradient: DeepSpeed 0.19.8 releases a leaf module's parameters
before its backward runs when none of its inputs does (its backward fails on empty weights).
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from actors.trace.conventions import trace_file_name
from actors.capture.recorder import record_iteration
from actors.rank_base import free_port

LEAF_PATTERNS = ["blocks.*", "moe"]


@dataclass
class FineGrainedConfig:
    """Sizes of the model and its batch."""

    d_model: int = 64  # width of every Linear
    num_blocks: int = 4  # Linear stacks
    linears_per_block: int = 6
    num_experts: int = 8
    expert_hidden: int = 64  # experts' inner width
    batch_size: int = 32  # rows per rank per step
    seed: int = 0  # same initial weights on every rank; rank r's data from seed + 1 + r


class LinearStack(nn.Module):
    """Several small Linear layers with a residual GELU between them."""

    def __init__(self, d: int, n: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = x + F.gelu(layer(x))
        return x


class Expert(nn.Module):
    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class MoE(nn.Module):
    """A gate and experts; the output mixes every expert by the gate's weights."""

    def __init__(self, d: int, hidden: int, num_experts: int):
        super().__init__()
        self.gate = nn.Linear(d, num_experts)
        self.experts = nn.ModuleList(Expert(d, hidden) for _ in range(num_experts))

    def forward(self, x):
        weights = F.softmax(self.gate(x), dim=-1)
        out = x
        for e, expert in enumerate(self.experts):
            out = out + weights[:, e:e + 1] * expert(x)
        return out


class FineGrained(nn.Module):
    def __init__(self, cfg: FineGrainedConfig):
        super().__init__()
        self.stem = nn.Linear(cfg.d_model, cfg.d_model)
        self.blocks = nn.ModuleList(LinearStack(cfg.d_model, cfg.linears_per_block)
                                    for _ in range(cfg.num_blocks))
        self.moe = MoE(cfg.d_model, cfg.expert_hidden, cfg.num_experts)
        self.head = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x, target):
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return F.mse_loss(self.head(self.moe(x)), target)


def leaf_classes() -> list[type]:
    """The module classes that ``LEAF_PATTERNS`` name (for DeepSpeed's set_z3_leaf_modules)."""
    return [LinearStack, MoE]


def build(cfg: FineGrainedConfig, rank: int):
    """(model, batch source): identical weights on every rank, per-rank data."""
    torch.manual_seed(cfg.seed)
    model = FineGrained(cfg)
    gen = torch.Generator().manual_seed(cfg.seed + 1 + rank)

    def next_batch():
        return (torch.randn(cfg.batch_size, cfg.d_model, generator=gen),
                torch.randn(cfg.batch_size, cfg.d_model, generator=gen))
    return model, next_batch


def _capture_rank(rank: int, world: int, port: int, out_dir: str, cfg: FineGrainedConfig,
                  grad_all_reduce: bool = True) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=120))
    model, next_batch = build(cfg, rank)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(batch):
        opt.zero_grad(set_to_none=True)
        model(*batch).backward()
        for p in model.parameters():  # data parallel: one all-reduce per gradient
            if grad_all_reduce:
                dist.all_reduce(p.grad)
            p.grad.div_(world)
        opt.step()

    step(next_batch())  # warm-up: optimizer state exists before the recorded step
    record_iteration(step, next_batch(), model, 1, str(Path(out_dir) / trace_file_name(rank)))
    dist.destroy_process_group()
    # torch 2.13 may abort in C++ static destructors after a gloo + ET run (see
    # tests/support/trace_factory.py); the trace is written: leave without finalization.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def capture_data_parallel(out_dir: Path, world: int, cfg: FineGrainedConfig,
                          grad_all_reduce: bool = True) -> Path:
    """One recorded data-parallel training step per rank in ``out_dir`` (gloo, CPU).
    ``grad_all_reduce=False`` leaves out the gradients' all-reduces (the averaging stays): a
    ZeRO-3 replay of that trace reduce-scatters them itself, as DeepSpeed does, instead of
    also replaying the data-parallel all-reduces."""
    import torch.multiprocessing as mp

    out_dir.mkdir(parents=True, exist_ok=True)
    mp.spawn(_capture_rank, args=(world, free_port(), str(out_dir), cfg, grad_all_reduce),
             nprocs=world)
    return out_dir
