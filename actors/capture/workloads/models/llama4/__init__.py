"""Llama 4 (Scout, Maverick): Llama's decoder with routed + shared experts in every
``moe_every``-th block (top-1, sigmoid scores), chunked attention in the blocks with rotary
embeddings and a NoPE block every ``nope_every`` (model.py). Presets:
conf/workload/llama4_*.yaml, from the model cards and torchtitan's llama4 training configs.
Mesh: FSDP2 / HSDP, tp (the MoE blocks' experts split by hidden unit: expert tensor parallel,
actors/capture/workloads/parallelize/tensor_parallel.py), pp, ep; cp is not built for chunked
attention."""
from __future__ import annotations

from actors.capture.workloads.models.llama import build_llama, llama_ffn_dim, validate_llama
from actors.capture.workloads.models.llama.model import Llama, TransformerBlock
from actors.capture.workloads.models.llama4.model import ChunkedAttention
from actors.capture.workloads.models.spec import ModelSpec
from actors.errors import ConfigError


def _build(cfg, ffn_dim: int, moe) -> Llama:
    model = build_llama(cfg, ffn_dim, moe, attention_class=ChunkedAttention)
    for i, block in enumerate(model.layers):
        block.attention.use_rope = not cfg.nope_every or (i + 1) % cfg.nope_every != 0
        block.attention.chunk = cfg.attention_chunk
    return model


def _validate(cfg) -> None:
    """Llama's checks, and chunks that split the sequence evenly."""
    validate_llama(cfg)
    chunk = cfg.attention_chunk
    if chunk and cfg.seq_len > chunk and cfg.seq_len % chunk:
        raise ConfigError(f"workload.attention_chunk={chunk} does not split workload.seq_len="
                          f"{cfg.seq_len} into whole chunks")


SPEC = ModelSpec(name="llama4", build=_build, block_class=TransformerBlock,
                 blocks=lambda m: m.layers, default_ffn_dim=llama_ffn_dim, validate=_validate,
                 mesh_dims=frozenset(("dp_replicate", "dp_shard", "tp", "pp", "ep")), moe=True)
