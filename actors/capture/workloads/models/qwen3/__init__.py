"""Qwen3, dense and MoE: Llama's decoder with per-head q/k RMSNorm (model.py), an explicit
head size (workload.head_dim, 128 in the public sizes), tied embeddings in the small sizes
(workload.tie_embeddings) and, in the MoE sizes, routed experts without shared ones whose
top-k scores are renormalized per token. Presets: conf/workload/qwen3_*.yaml, from the model
cards and torchtitan's qwen3 training configs."""
from __future__ import annotations

from actors.capture.workloads.models.llama import build_llama, llama_ffn_dim, validate_llama
from actors.capture.workloads.models.llama.model import TransformerBlock
from actors.capture.workloads.models.qwen3.model import QKNormAttention
from actors.capture.workloads.models.spec import ALL_MESH_DIMS, ModelSpec


def _build(cfg, ffn_dim: int, moe):
    return build_llama(cfg, ffn_dim, moe, attention_class=QKNormAttention)


SPEC = ModelSpec(name="qwen3", build=_build, block_class=TransformerBlock,
                 blocks=lambda m: m.layers, default_ffn_dim=llama_ffn_dim,
                 validate=validate_llama, mesh_dims=ALL_MESH_DIMS, moe=True,
                 moe_normalize_top_k=True)
