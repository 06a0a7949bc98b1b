"""Llama (2, 3, 3.x): RMSNorm, rotary embeddings, grouped-query attention, SwiGLU or MoE
feed-forward (model.py); the N-D mesh recipes (actors/capture/workloads/parallelize/) are written
for its module names."""
from __future__ import annotations

from actors.capture.workloads.models.llama.model import GQAttention, Llama, TransformerBlock
from actors.capture.workloads.models.spec import ALL_MESH_DIMS, ModelSpec
from actors.errors import ConfigError


def llama_ffn_dim(d_model: int) -> int:
    """Meta's reference rule: 2/3 of 4 x d_model rounded up to a multiple of 256."""
    return -(-int(2 * 4 * d_model / 3) // 256) * 256


def build_llama(cfg, ffn_dim: int, moe, attention_class: type = GQAttention,
                rope_dim: int = 0) -> Llama:
    """A Llama-shaped decoder from ``cfg``; families built on it pass their attention (and
    the rotated width, when it is not the head size)."""
    return Llama(cfg.vocab, cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads or cfg.n_heads,
                 ffn_dim, cfg.seq_len, cfg.rope_theta, cfg.norm_eps, cfg.attention, moe,
                 head_dim=cfg.head_dim, tie_embeddings=cfg.tie_embeddings,
                 loss_chunks=cfg.loss_chunks, attention_class=attention_class,
                 dense_layers=cfg.moe_dense_layers, rope_dim=rope_dim,
                 moe_every=cfg.moe_every)


def validate_llama(cfg) -> None:
    """Heads, key/value heads and the head size of a Llama-shaped decoder."""
    if not cfg.head_dim and cfg.d_model % cfg.n_heads:
        raise ConfigError(f"workload.d_model={cfg.d_model} is not divisible by "
                          f"workload.n_heads={cfg.n_heads} (or set workload.head_dim)")
    if cfg.n_heads % (cfg.n_kv_heads or cfg.n_heads):
        raise ConfigError(f"workload.n_heads={cfg.n_heads} is not divisible by "
                          f"workload.n_kv_heads={cfg.n_kv_heads}")
    latent = [f"workload.{n}={getattr(cfg, n)}" for n in ("mla_kv_lora_rank", "mla_q_lora_rank",
                                                          "mla_v_head_dim") if getattr(cfg, n)]
    if latent:
        raise ConfigError(f"{', '.join(latent)}: multi-head latent attention is "
                          f"workload.model=deepseek_v3's (got {cfg.model})")
    head_dim = cfg.head_dim or cfg.d_model // cfg.n_heads
    if head_dim % 2:
        raise ConfigError(f"workload head size {head_dim} (head_dim, or d_model / n_heads): "
                          "rotary embeddings need an even head size")


SPEC = ModelSpec(name="llama", build=build_llama, block_class=TransformerBlock,
                 blocks=lambda m: m.layers, default_ffn_dim=llama_ffn_dim,
                 validate=validate_llama, mesh_dims=ALL_MESH_DIMS, moe=True)
