"""A fine-grained model for ZeRO-3 studies (captured with data parallel by
actors/capture/finegrained_capture.py).

A stem Linear, blocks of several small Linear layers, then an MoE-style block (a gate and ``num_experts``
two-layer experts, every expert applied to every token and mixed by the gate's softmax, so
each expert runs on every rank in every step), then a head: many small modules, the case
where ZeRO-3 pays a host cost per parameter. Its natural ZeRO-3 leaves are the Linear
stacks and the MoE block (``LEAF_PATTERNS``, ``leaf_classes()``). The stem keeps every leaf's
input a tensor that needs a gradient: DeepSpeed 0.19.8 releases a leaf module's parameters
before its backward runs when none of its inputs does (its backward fails on empty weights).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

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
