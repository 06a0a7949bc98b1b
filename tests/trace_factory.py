"""Capture small, real Execution Traces in-process for tests (one rank, gloo world of 1)."""
from __future__ import annotations

import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


class IndexHeavy(nn.Module):
    """Embedding, gather, index_select and a cross-entropy loss: every index-op family."""

    def __init__(self, vocab=50, dim=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.proj = nn.Linear(dim, vocab)
        self.norm = nn.LayerNorm(dim)

    def forward(self, tokens):
        h = self.norm(self.emb(tokens))
        h = torch.index_select(h, 1, torch.arange(h.shape[1] - 1, -1, -1))
        logits = self.proj(F.scaled_dot_product_attention(h, h, h, is_causal=True))
        picked = torch.gather(logits, 2, tokens.unsqueeze(-1) % logits.shape[-1])
        return F.cross_entropy(logits.flatten(0, 1), tokens.flatten()) + picked.mean()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def capture_step(path: Path, with_ranges: bool = True, with_collective: bool = True) -> Path:
    """Record one training step of `IndexHeavy` (after one warm-up step) into ``path``."""
    from torch.profiler import ExecutionTraceObserver

    if with_ranges:
        os.environ["ENABLE_PYTORCH_EXECUTION_TRACE_SAVE_INTEGRAL_TENSOR_RANGE"] = "1"
    else:
        os.environ.pop("ENABLE_PYTORCH_EXECUTION_TRACE_SAVE_INTEGRAL_TENSOR_RANGE", None)
    torch.manual_seed(0)
    model = IndexHeavy()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    own_group = with_collective and not dist.is_initialized()
    if own_group:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}",
                                rank=0, world_size=1)

    def step():
        tokens = torch.randint(0, 50, (4, 12))
        loss = model(tokens)
        loss.backward()
        if with_collective:
            for p in model.parameters():
                dist.all_reduce(p.grad)
        opt.step()
        opt.zero_grad()

    try:
        step()
        et = ExecutionTraceObserver()
        et.register_callback(str(path))
        et.start()
        with torch.profiler.record_function("ProfilerStep#1"):
            step()
        et.stop()
        et.unregister_callback()
    finally:
        if own_group:
            dist.destroy_process_group()
    return path
