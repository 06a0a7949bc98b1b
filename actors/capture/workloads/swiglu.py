"""The SwiGLU feed-forward of Llama-style blocks: a dense block's (models/llama/model.py) and
the shared experts of a Mixture of Experts (moe.py)."""
from __future__ import annotations

import torch.nn.functional as F
from torch import nn


class SwiGLU(nn.Module):
    """``w2(silu(w1 x) * w3 x)``, no biases."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))
