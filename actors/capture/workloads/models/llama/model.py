"""A Llama-style decoder: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU FFN.

Shaped like Meta's reference model (``tok_embeddings``, ``layers.<i>.attention.wq/wk/wv/wo``,
``feed_forward.w1/w2/w3``, ``attention_norm``, ``ffn_norm``, ``norm``, ``output``; no biases).
It builds and trains on the ``meta`` device too, where every op runs on shapes only, so a
70B-class model is traced in seconds. Attention is fused or math
(actors/capture/workloads/attention.py). Families built on it (Qwen3,
actors/capture/workloads/models/qwen3/) pass their own attention class, a head size other than
``dim / n_heads``, tied input and output embeddings.

The loss is the mean cross-entropy over the vocabulary's float32 logits, computed whole or in
``loss_chunks`` slices of the tokens (:func:`chunked_cross_entropy`).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from torch.utils.checkpoint import checkpoint

from actors.capture.workloads.attention import Attention, causal_attention
from actors.capture.workloads.moe import MoE, MoeSpec
from actors.capture.workloads.swiglu import SwiGLU


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


def apply_rotary(x, cos, sin):
    """Rotary embedding of x (b, heads, t, head_dim): x cos + rotate_half(x) sin."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    # In x's dtype: under autocast the tables stay float32 (as the reference trainers compute
    # rotary embeddings in float32) and the attention kernel gets bf16 q and k.
    return (x * cos + rotated * sin).type_as(x)


def repeat_kv(x, n_rep: int):
    """(b, kv_heads, t, d) -> (b, kv_heads * n_rep, t, d): each KV head serves n_rep heads."""
    if n_rep == 1:
        return x
    b, h, t, d = x.shape
    return x[:, :, None].expand(b, h, n_rep, t, d).reshape(b, h * n_rep, t, d)


class GQAttention(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, head_dim: int,
                 attention: Attention, eps: float):
        super().__init__()
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        self.head_dim = head_dim
        self.attention = attention
        # context parallel's ring attention
        # (actors/capture/workloads/parallelize/context_parallel.py)
        self.context_parallel = None
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def project(self, x):
        """q, k, v as (b, t, heads, head_dim); -1 heads: under tensor parallel each rank holds
        n_heads / tp of them."""
        b, t, _ = x.shape
        return (self.wq(x).view(b, t, -1, self.head_dim), self.wk(x).view(b, t, -1, self.head_dim),
                self.wv(x).view(b, t, -1, self.head_dim))

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        y = self.attend(*self.project(x), cos, sin)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))

    def attend(self, q, k, v, cos, sin):
        """Causal attention of (samples, t, heads, head_dim) q, k, v, rotated by the ``cos``
        and ``sin`` tables (None: not rotated): (samples, heads, t, head_dim)."""
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        if cos is not None:
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        n_rep = self.n_heads // self.n_kv_heads
        if self.context_parallel is None:
            return causal_attention(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep), self.attention)
        return self.context_parallel(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep))


class TransformerBlock(nn.Module):
    """One pre-norm Llama block: the unit ZeRO-3 leaf mode fetches at once. With ``moe`` its
    feed-forward is a Mixture of Experts (actors/capture/workloads/moe.py)."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, head_dim: int, ffn_dim: int,
                 eps: float, attention: Attention, moe: MoeSpec | None = None,
                 attention_class: type[GQAttention] = GQAttention):
        super().__init__()
        self.attention_norm = RMSNorm(dim, eps)
        self.attention = attention_class(dim, n_heads, n_kv_heads, head_dim, attention, eps)
        self.ffn_norm = RMSNorm(dim, eps)
        self.feed_forward = SwiGLU(dim, ffn_dim) if moe is None else MoE(dim, moe)

    def forward(self, x, cos, sin):
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    """Token embedding, Llama blocks, final RMSNorm, output projection.

    ``forward(idx, targets)`` returns the mean cross-entropy loss (computed in float32).
    The rotary tables are non-persistent buffers made on the model's device. ``head_dim`` 0:
    ``dim / n_heads``. ``tie_embeddings``: the output projection is the token embedding's
    weight (one parameter). ``loss_chunks`` > 1: :func:`chunked_cross_entropy`. With ``moe``,
    the first ``dense_layers`` blocks keep the dense feed-forward (DeepSeek's), and of the
    others every ``moe_every``-th (counting from 1) is MoE (Llama 4's interleave). ``rope_dim``:
    the rotary tables' width when only part of a head is rotated (DeepSeek's MLA); 0 =
    ``head_dim``.
    """

    def __init__(self, vocab: int, dim: int, n_layers: int, n_heads: int, n_kv_heads: int,
                 ffn_dim: int, seq_len: int, rope_theta: float, norm_eps: float,
                 attention: Attention, moe: MoeSpec | None = None, head_dim: int = 0,
                 tie_embeddings: bool = False, loss_chunks: int = 1,
                 attention_class: type[GQAttention] = GQAttention, dense_layers: int = 0,
                 rope_dim: int = 0, moe_every: int = 1):
        super().__init__()
        head_dim = head_dim or dim // n_heads
        self.loss_chunks = loss_chunks
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(
            TransformerBlock(dim, n_heads, n_kv_heads, head_dim, ffn_dim, norm_eps, attention,
                             moe if i >= dense_layers and (i + 1) % moe_every == 0 else None,
                             attention_class)
            for i in range(n_layers))
        self.norm = RMSNorm(dim, norm_eps)
        self.output = nn.Linear(dim, vocab, bias=False)
        if tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        cos, sin = rotary_tables(rope_dim or head_dim, seq_len, rope_theta,
                                 self.output.weight.device)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, idx, targets):
        t = idx.shape[1]
        cos, sin = self.rope_cos[:t], self.rope_sin[:t]  # cast with the model by .to(dtype)
        h = self.tok_embeddings(idx)
        for layer in self.layers:
            h = layer(h, cos, sin)
        h = self.norm(h)
        if self.loss_chunks > 1:
            return chunked_cross_entropy(self.output, h, targets, self.loss_chunks)
        logits = self.output(h).float()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


def _chunk_loss(output: nn.Module, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The summed cross-entropy of one slice of tokens."""
    logits = output(h).float()
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1),
                           reduction="sum")


def chunked_cross_entropy(output: nn.Module, h: torch.Tensor, targets: torch.Tensor,
                          num_chunks: int) -> torch.Tensor:
    """The mean cross-entropy with at most one slice's logits alive at a time.

    The tokens are split into ``num_chunks`` slices; each slice's float32 logits are computed,
    reduced to a summed loss and dropped, and recomputed in backward (each slice runs under
    activation checkpointing), so the vocabulary-wide logits of the whole batch, often a
    step's peak with a 128k-152k vocabulary, are never held at once: the chunked loss of
    torchtitan's and Liger's recipes, at the price of one more output projection per slice.
    """
    flat_h, flat_targets = h.reshape(-1, h.shape[-1]), targets.reshape(-1)
    total = None
    for part_h, part_t in zip(flat_h.chunk(num_chunks), flat_targets.chunk(num_chunks)):
        part = checkpoint(_chunk_loss, output, part_h, part_t, use_reentrant=False)
        total = part if total is None else total + part
    return total / flat_targets.numel()
