"""GPT: learned positions, LayerNorm, GELU MLP, biases (model.py)."""
from __future__ import annotations

from actors.capture.workloads.models.gpt.model import GPT, Block
from actors.capture.workloads.models.spec import ModelSpec
from actors.errors import ConfigError


def _build(cfg, ffn_dim: int, moe) -> GPT:
    return GPT(cfg.vocab, cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.seq_len, ffn_dim,
               cfg.attention)


def _validate(cfg) -> None:
    """The Llama-family knobs GPT has no use for are refused, not ignored."""
    if cfg.d_model % cfg.n_heads:
        raise ConfigError(f"workload.d_model={cfg.d_model} is not divisible by "
                          f"workload.n_heads={cfg.n_heads}")
    for name, unset in (("n_kv_heads", (0, cfg.n_heads)), ("head_dim", (0,)),
                        ("tie_embeddings", (False,)), ("loss_chunks", (1,)),
                        ("mla_kv_lora_rank", (0,))):
        if getattr(cfg, name) not in unset:
            raise ConfigError(f"workload.{name}={getattr(cfg, name)} is a knob of the "
                              "Llama-style families (llama, qwen3, deepseek_v3); "
                              f"workload.model=gpt needs {unset[0]}")


SPEC = ModelSpec(name="gpt", build=_build, block_class=Block, blocks=lambda m: m.blocks,
                 default_ffn_dim=lambda d_model: 4 * d_model, validate=_validate,
                 mesh_dims=frozenset(), moe=False)
