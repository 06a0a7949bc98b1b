"""Qwen3's attention: Llama's grouped-query attention with an RMSNorm over each head's query
and key (``q_norm``, ``k_norm``, one ``head_dim`` weight each) before the rotary embedding, as
the Qwen3 models and torchtitan's qwen3 compute it. The rest of a Qwen3 block, and the
decoder around it, is Llama's (actors/capture/workloads/models/llama/model.py) with an explicit
``head_dim`` (128 in every public size; Qwen3-32B: 64 heads x 128 = 8192 wide on a 5120
model) and, in the small sizes, tied embeddings."""
from __future__ import annotations

from actors.capture.workloads.attention import Attention
from actors.capture.workloads.models.llama.model import GQAttention, RMSNorm


class QKNormAttention(GQAttention):
    """Grouped-query attention with per-head q/k RMSNorm."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, head_dim: int,
                 attention: Attention, eps: float):
        super().__init__(dim, n_heads, n_kv_heads, head_dim, attention, eps)
        self.q_norm = RMSNorm(head_dim, eps)
        self.k_norm = RMSNorm(head_dim, eps)

    def project(self, x):
        q, k, v = super().project(x)
        return self.q_norm(q), self.k_norm(k), v
