"""A small GPT-style decoder: learned positions, LayerNorm, causal attention (fused or math, see
actors/capture/workloads/attention.py), GELU MLP."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from actors.capture.workloads.attention import Attention, causal_attention


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, attention: Attention):
        super().__init__()
        self.n_heads, self.attention = n_heads, attention
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, c // self.n_heads).transpose(1, 2) for z in (q, k, v))
        y = causal_attention(q, k, v, self.attention)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class MLP(nn.Module):
    def __init__(self, d_model: int, ffn_dim: int):
        super().__init__()
        self.fc = nn.Linear(d_model, ffn_dim)
        self.proj = nn.Linear(ffn_dim, d_model)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """One pre-norm decoder block: the unit ZeRO-3 leaf mode fetches at once."""

    def __init__(self, d_model: int, n_heads: int, ffn_dim: int, attention: Attention):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads, attention)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model, ffn_dim)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Token + learned position embedding, decoder blocks, final norm, LM head.

    ``forward(idx, targets)`` returns the mean cross-entropy loss, computed on float32 logits
    (as the reference trainers do: a bf16 softmax over a large vocabulary loses precision).
    """

    def __init__(self, vocab: int, d_model: int, n_layers: int, n_heads: int, seq_len: int,
                 ffn_dim: int, attention: Attention = Attention.fused):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, d_model)
        self.pos_emb = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, ffn_dim, attention)
                                    for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, idx, targets):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x)).float()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))
