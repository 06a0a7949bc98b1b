"""What a model family tells the capture: :class:`ModelSpec`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

ALL_MESH_DIMS = frozenset(("dp_replicate", "dp_shard", "tp", "pp", "cp", "ep"))

import torch.nn as nn


@dataclass(frozen=True)
class ModelSpec:
    """One model family, as the capture, the mesh recipes and the checks ask for it."""

    name: str  # workload.model's value
    # (workload config, feed-forward hidden size, MoE spec or None) -> the model, in float32,
    # on the current default device
    build: Callable[..., nn.Module]
    block_class: type  # the decoder block: ZeRO-3's leaf unit, FSDP2's unit
    blocks: Callable[[nn.Module], nn.ModuleList]  # the model's decoder blocks
    default_ffn_dim: Callable[[int], int]  # d_model -> the feed-forward size when ffn_dim = 0
    # the family's own checks of a workload config (ConfigError naming the field)
    validate: Callable[[object], None]
    # the mesh degrees (actors/capture/workloads/mesh.py's names) its recipes may set above 1: tp
    # and cp need Llama's attention module names, pp its layers and ep its MoE blocks
    mesh_dims: frozenset
    moe: bool  # its feed-forward may be a Mixture of Experts (workload.moe_experts)
    # MoE: the chosen experts' scores renormalized per token (Qwen3-MoE's norm_topk_prob)
    moe_normalize_top_k: bool = False
    # (workload config) -> its attention's values are narrower than its queries and keys
    # (DeepSeek's MLA), so a GPU's SDPA runs the memory-efficient kernel whatever the dtype
    narrower_values: Callable[[object], bool] = lambda cfg: False
