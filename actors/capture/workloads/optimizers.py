"""The built-in recipes' optimizer (``workload.optimizer``): torch's AdamW (fused on a GPU
target, as torchtitan steps it), or torchao's low-bit AdamW (torchao.optim ``AdamW8bit`` /
``AdamW4bit``, torchtitan's users' way to fit a model's optimizer state: the two moments
quantized block-wise, 1 or 1/2 byte per element plus one float32 scale per block, instead of
4 + 4 bytes).

torchao steps each parameter with a ``torch.compile``-d function; on the fake device that
compiles as any compiled step does (actors/capture/fake/compiled_on_fake.py), so its buffers are
inductor's own. torchao keeps small or oddly sized tensors' moments in full precision
(``_new_buffer``: fewer than 4096 elements, or a size its block does not divide); the capture
runs torchao's own code, so its trace holds what torchao allocates.
"""
from __future__ import annotations

from typing import Iterable

import torch

from actors.choices import Choice


class OptimizerName(Choice):
    """The optimizer the built-in recipes step."""

    adamw = "adamw"  # torch.optim.AdamW: float32 moments (8 bytes per parameter element)
    adamw_8bit = "adamw_8bit"  # torchao.optim.AdamW8bit: uint8 codes, a scale per 256 elements
    adamw_4bit = "adamw_4bit"  # torchao.optim.AdamW4bit: 4-bit codes, a scale per 128 elements


def make_optimizer(cfg, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """``cfg.optimizer`` (a WorkloadConfig's) over ``params``, at ``cfg.lr``."""
    params = list(params)
    if cfg.optimizer == OptimizerName.adamw:
        # a GPU target's step runs torchtitan's default, the fused kernel (its
        # optimizer.implementation); elsewhere torch's default, the CPU's for-loop
        fused = True if cfg.gpu_kernels and cfg.device == "fake" else None
        return torch.optim.AdamW(params, lr=cfg.lr, fused=fused)
    from torch._functorch import config as functorch_config
    from torchao.optim import AdamW4bit, AdamW8bit

    _quantization_maps()
    # AOTAutograd's cache keys torchao's state subclasses without their layout (they define
    # no _stable_hash_for_caching): a 4-bit run then loaded an 8-bit run's compiled update
    # from the same cache folder and failed on the codes' dimensions (seen on cpu)
    functorch_config.enable_autograd_cache = False
    low_bit = {OptimizerName.adamw_8bit: AdamW8bit, OptimizerName.adamw_4bit: AdamW4bit}
    return low_bit[cfg.optimizer](params, lr=cfg.lr)


def _quantization_maps() -> None:
    """Compute torchao's code books (lru-cached tuples of floats) from real tensors: under the
    fake device their tensors would have no values to read."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torchao.optim import subclass_4bit, subclass_8bit

    with unset_fake_temporarily():
        for module in (subclass_8bit, subclass_4bit):
            module.get_qmap_signed()
            module.get_qmap_unsigned()
