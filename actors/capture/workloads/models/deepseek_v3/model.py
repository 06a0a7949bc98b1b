"""DeepSeek-V3's multi-head latent attention (MLA), as DeepSeek's reference model and
torchtitan's deepseek_v3 compute it.

Queries come from the hidden state directly (``wq``) or through a low-rank bottleneck
(``wq_a``, an RMSNorm, ``wq_b``: ``q_lora_rank``); keys and values through one
(``wkv_a`` to ``kv_lora_rank`` plus a shared rotary part, ``kv_norm``, ``wkv_b``). Each head's
query and key are a non-rotated part (``head_dim``, DeepSeek's ``qk_nope_head_dim``) and a
rotated one (``rope_dim``; the key's is one for every head), values are ``v_head_dim`` wide.
The rest of a DeepSeek-V3 block and decoder is Llama's
(actors/capture/workloads/models/llama/model.py) with its first ``dense_layers`` blocks dense and
the others MoE (actors/capture/workloads/moe.py)."""
from __future__ import annotations

import torch
import torch.nn as nn

from actors.capture.workloads.attention import Attention, causal_attention
from actors.capture.workloads.models.llama.model import RMSNorm, apply_rotary


class LatentAttention(nn.Module):
    """Multi-head latent attention (see the module docstring)."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, head_dim: int,
                 attention: Attention, eps: float, *, q_lora_rank: int, kv_lora_rank: int,
                 rope_dim: int, v_head_dim: int):
        super().__init__()
        del n_kv_heads  # every head has its own key and value, made from the shared latent
        self.nope_dim, self.rope_dim, self.v_head_dim = head_dim, rope_dim, v_head_dim
        self.kv_lora_rank = kv_lora_rank
        self.attention = attention
        # context parallel's ring attention
        # (actors/capture/workloads/parallelize/context_parallel.py)
        self.context_parallel = None
        qk_dim = head_dim + rope_dim
        if q_lora_rank:
            self.wq_a = nn.Linear(dim, q_lora_rank, bias=False)
            self.q_norm = RMSNorm(q_lora_rank, eps)
            self.wq_b = nn.Linear(q_lora_rank, n_heads * qk_dim, bias=False)
        else:
            self.wq = nn.Linear(dim, n_heads * qk_dim, bias=False)
        self.wkv_a = nn.Linear(dim, kv_lora_rank + rope_dim, bias=False)
        self.kv_norm = RMSNorm(kv_lora_rank, eps)
        self.wkv_b = nn.Linear(kv_lora_rank, n_heads * (head_dim + v_head_dim), bias=False)
        self.wo = nn.Linear(n_heads * v_head_dim, dim, bias=False)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        q = self.wq(x) if hasattr(self, "wq") else self.wq_b(self.q_norm(self.wq_a(x)))
        q = q.view(b, t, -1, self.nope_dim + self.rope_dim).transpose(1, 2)
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        q = torch.cat([q_nope, apply_rotary(q_rope, cos, sin)], dim=-1)
        latent, k_rope = self.wkv_a(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        k_rope = apply_rotary(k_rope.unsqueeze(1), cos, sin)  # (b, 1, t, rope_dim): all heads'
        kv = self.wkv_b(self.kv_norm(latent)).view(b, t, -1, self.nope_dim + self.v_head_dim)
        k_nope, v = kv.transpose(1, 2).split([self.nope_dim, self.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(-1, k_nope.shape[1], -1, -1)], dim=-1)
        y = (causal_attention(q, k, v, self.attention) if self.context_parallel is None
             else self.context_parallel(q, k, v))
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))
