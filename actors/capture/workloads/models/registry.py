"""The model families by name: ``workload.model`` -> :class:`ModelSpec`. A new family is a
folder beside these with a ``SPEC``, one line here and its name in ``ModelName``
(actors/capture/workloads/config.py; tests/capture/test_model_registry.py checks the two
agree)."""
from __future__ import annotations

from actors.capture.workloads.models import deepseek_v3, gpt, llama, llama4, qwen3
from actors.capture.workloads.models.spec import ModelSpec

MODEL_SPECS: dict[str, ModelSpec] = {spec.name: spec for spec in (
    gpt.SPEC, llama.SPEC, qwen3.SPEC, deepseek_v3.SPEC, llama4.SPEC)}


def model_spec(name: str) -> ModelSpec:
    """The family registered as ``name`` (a ``ModelName``; custom steps have none)."""
    return MODEL_SPECS[str(name)]


def ffn_dim_of(cfg) -> int:
    """The dense feed-forward hidden size a workload config asks for: ``ffn_dim``, or its
    family's rule when 0 (see WorkloadConfig.ffn_dim)."""
    return cfg.ffn_dim or model_spec(cfg.model).default_ffn_dim(cfg.d_model)


def expert_ffn_dim(cfg) -> int:
    """An MoE expert's hidden size: ``moe_ffn_dim``, or the dense one when 0."""
    return cfg.moe_ffn_dim or ffn_dim_of(cfg)
