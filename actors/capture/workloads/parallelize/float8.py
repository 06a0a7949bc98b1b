"""float8 training with torchao, as torchtitan's ``float8`` converter applies it: every Linear
but the output projection (torchtitan's ``filter_fqns = ["output"]``) becomes a torchao
``Float8Linear`` with dynamic scaling by ``workload.float8_recipe``: tensorwise (inputs and
weights cast to e4m3, gradients to e5m2, matmuls as ``_scaled_mm``), or one of torchao's rowwise
recipes (``Float8LinearConfig.from_recipe_name``: a scale per row). Under FSDP2 tensorwise
weights are all-gathered in float8 (``enable_fsdp_float8_all_gather``: half of bf16's
all-gather bytes) unless ``workload.float8_all_gather=false``; rowwise weights in bf16, cast
after the gather.

torchao runs on the fake device (its tensor subclasses dispatch their local ops under the fake
mode, told apart by actors/capture/fake/subclass_frames.py), so a float8 job is captured like any
mesh job, one recorded rank (actors/capture/mesh_world.py). torchao is optional: without it
the knob is refused with the command that installs it.
"""
from __future__ import annotations

import torch.nn as nn

from actors.errors import ConfigError

SKIPPED = ("output",)  # torchtitan's filter_fqns: the LM head stays in bf16


def torchao_float8():
    """torchao's float8 module; ConfigError naming the install when it is missing."""
    try:
        from torchao import float8
    except ImportError as e:
        raise ConfigError("workload.float8=true trains with torchao's float8 linears; torchao "
                          f"is not importable ({e}): pip install torchao (it needs no other "
                          "torch)") from None
    return float8


def apply_float8(model: nn.Module, recipe: str, all_gather: bool | None, fsdp: bool) -> None:
    """Convert ``model``'s Linears in place with torchao's ``recipe`` (a Float8LinearRecipeName
    value); under FSDP2 (``fsdp``) float8 all-gathers unless ``all_gather`` is false, for
    tensorwise only (validate refuses them with a rowwise recipe)."""
    float8 = torchao_float8()
    if recipe == "tensorwise":
        config = float8.Float8LinearConfig(
            enable_fsdp_float8_all_gather=fsdp and all_gather is not False)
    else:
        config = float8.Float8LinearConfig.from_recipe_name(recipe)
    float8.convert_to_float8_training(
        model, config=config,
        module_filter_fn=lambda module, fqn: fqn.split(".")[-1] not in SKIPPED)
