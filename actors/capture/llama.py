"""A Llama-style decoder: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU FFN.

Shaped like Meta's reference model (``tok_embeddings``, ``layers.<i>.attention.wq/wk/wv/wo``,
``feed_forward.w1/w2/w3``, ``attention_norm``, ``ffn_norm``, ``norm``, ``output``; no biases).
It builds and trains on the ``meta`` device too, where every op runs on shapes only, so a
70B-class model is traced in seconds. Attention is fused or math (actors/capture/attention.py).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from actors.capture.attention import Attention, causal_attention
from actors.capture.moe import MoE, MoeSpec
from actors.capture.swiglu import SwiGLU


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        h = x.float()  # normalize in float32, as the reference does
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return h.type_as(x) * self.weight


def rotary_tables(head_dim: int, seq_len: int, theta: float, device) -> tuple:
    """cos and sin tables, (seq_len, head_dim), for rotate-half rotary embeddings."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device).float(), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def _rotate(x, cos, sin):
    """Rotary embedding of x (b, heads, t, head_dim): x cos + rotate_half(x) sin."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    # In x's dtype: under autocast the tables stay float32 (as the reference trainers compute
    # rotary embeddings in float32) and the attention kernel gets bf16 q and k.
    return (x * cos + rotated * sin).type_as(x)


def _repeat_kv(x, n_rep: int):
    """(b, kv_heads, t, d) -> (b, kv_heads * n_rep, t, d): each KV head serves n_rep heads."""
    if n_rep == 1:
        return x
    b, h, t, d = x.shape
    return x[:, :, None].expand(b, h, n_rep, t, d).reshape(b, h * n_rep, t, d)


class GQAttention(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, attention: Attention):
        super().__init__()
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        self.head_dim = dim // n_heads
        self.attention = attention
        # context parallel's ring attention (actors/capture/parallelize/context_parallel.py)
        self.context_parallel = None
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        # -1 heads: under tensor parallel each rank holds n_heads / tp of them
        q = self.wq(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        n_rep = self.n_heads // self.n_kv_heads
        if self.context_parallel is None:
            y = causal_attention(q, _repeat_kv(k, n_rep), _repeat_kv(v, n_rep), self.attention)
        else:
            y = self.context_parallel(q, _repeat_kv(k, n_rep), _repeat_kv(v, n_rep))
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class TransformerBlock(nn.Module):
    """One pre-norm Llama block: the unit ZeRO-3 leaf mode fetches at once. With ``moe`` its
    feed-forward is a Mixture of Experts (actors/capture/moe.py)."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, ffn_dim: int, eps: float,
                 attention: Attention, moe: MoeSpec | None = None):
        super().__init__()
        self.attention_norm = RMSNorm(dim, eps)
        self.attention = GQAttention(dim, n_heads, n_kv_heads, attention)
        self.ffn_norm = RMSNorm(dim, eps)
        self.feed_forward = SwiGLU(dim, ffn_dim) if moe is None else MoE(dim, moe)

    def forward(self, x, cos, sin):
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    """Token embedding, Llama blocks, final RMSNorm, output projection.

    ``forward(idx, targets)`` returns the mean cross-entropy loss (computed in float32).
    The rotary tables are non-persistent buffers made on the model's device.
    """

    def __init__(self, vocab: int, dim: int, n_layers: int, n_heads: int, n_kv_heads: int,
                 ffn_dim: int, seq_len: int, rope_theta: float, norm_eps: float,
                 attention: Attention, moe: MoeSpec | None = None):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(
            TransformerBlock(dim, n_heads, n_kv_heads, ffn_dim, norm_eps, attention, moe)
            for _ in range(n_layers))
        self.norm = RMSNorm(dim, norm_eps)
        self.output = nn.Linear(dim, vocab, bias=False)
        cos, sin = rotary_tables(dim // n_heads, seq_len, rope_theta, self.output.weight.device)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, idx, targets):
        t = idx.shape[1]
        cos, sin = self.rope_cos[:t], self.rope_sin[:t]  # cast with the model by .to(dtype)
        h = self.tok_embeddings(idx)
        for layer in self.layers:
            h = layer(h, cos, sin)
        logits = self.output(self.norm(h)).float()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))
