"""DeepSeek-V3 (and its 16B, DeepSeek-MoE-shaped flavor; Kimi-K2 is the same architecture):
multi-head latent attention (model.py), the first ``moe_dense_layers`` blocks dense, the
others MoE with routed and shared experts, sigmoid scores and node-limited routing
(``moe_score``, ``moe_groups``, ``moe_limited_groups``: actors/capture/workloads/moe.py, under its
routing assumption). Presets: conf/workload/deepseek_v3_*.yaml, from the model cards and
torchtitan's deepseek_v3 training configs. Mesh: FSDP2 / HSDP, tp (MLA's plan in
actors/capture/workloads/parallelize/tensor_parallel.py; the MoE blocks' experts split by hidden
unit), pp, ep and cp (ring attention on MLA's queries, keys and narrower values)."""
from __future__ import annotations

from functools import partial

from actors.capture.workloads.models.deepseek_v3.model import LatentAttention
from actors.capture.workloads.models.llama import build_llama, llama_ffn_dim
from actors.capture.workloads.models.llama.model import TransformerBlock
from actors.capture.workloads.models.spec import ModelSpec
from actors.errors import ConfigError


def _value_width(cfg) -> int:
    """Each head's value size: ``mla_v_head_dim``, or ``head_dim`` when 0."""
    return cfg.mla_v_head_dim or cfg.head_dim


def _narrower_values(cfg) -> bool:
    return _value_width(cfg) < cfg.head_dim + cfg.mla_rope_head_dim


def _build(cfg, ffn_dim: int, moe):
    attention = partial(LatentAttention, q_lora_rank=cfg.mla_q_lora_rank,
                        kv_lora_rank=cfg.mla_kv_lora_rank, rope_dim=cfg.mla_rope_head_dim,
                        v_head_dim=_value_width(cfg))
    return build_llama(cfg, ffn_dim, moe, attention_class=attention,
                       rope_dim=cfg.mla_rope_head_dim)


def _validate(cfg) -> None:
    """MLA's sizes: a latent, a head size, an even rotated part, values no wider than q."""
    where = "workload.model=deepseek_v3"
    if cfg.mla_kv_lora_rank < 1 or cfg.head_dim < 1:
        raise ConfigError(f"{where} needs workload.mla_kv_lora_rank >= 1 and workload.head_dim "
                          f">= 1 (DeepSeek-V3: 512 and 128; got {cfg.mla_kv_lora_rank} and "
                          f"{cfg.head_dim})")
    if cfg.mla_rope_head_dim < 2 or cfg.mla_rope_head_dim % 2:
        raise ConfigError(f"workload.mla_rope_head_dim={cfg.mla_rope_head_dim}: rotary "
                          "embeddings need an even size >= 2 (DeepSeek-V3: 64)")
    v = _value_width(cfg)
    if v > cfg.head_dim + cfg.mla_rope_head_dim:
        raise ConfigError(f"workload.mla_v_head_dim={v} is wider than the query and key heads "
                          f"(head_dim + mla_rope_head_dim = "
                          f"{cfg.head_dim + cfg.mla_rope_head_dim})")


SPEC = ModelSpec(name="deepseek_v3", build=_build, block_class=TransformerBlock,
                 blocks=lambda m: m.layers, default_ffn_dim=llama_ffn_dim, validate=_validate,
                 mesh_dims=frozenset(("dp_replicate", "dp_shard", "tp", "pp", "cp", "ep")),
                 moe=True, narrower_values=_narrower_values)
