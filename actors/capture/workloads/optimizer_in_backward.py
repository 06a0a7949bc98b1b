"""The optimizer step in backward (torchtitan's ``optimizer.early_step_in_backward``): one
optimizer per parameter, stepped by the parameter's post-accumulate-grad hook as soon as its
gradient is whole, the gradient freed right after, so no step holds the whole model's
gradients at once.

FSDP2 runs these hooks on the sharded parameter once the reduce-scatter wrote its gradient
shard (``foreach_reduce``), which is why the recipe is FSDP2's; gradient accumulation would
step every micro-batch, and a pipeline's stages reduce after the schedule, so neither takes it
(actors/capture/workloads/config.py refuses them).
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch
import torch.nn as nn


class OptimizersInBackward:
    """One ``make([p])`` optimizer per trainable parameter of ``params``, each stepped and its
    gradient set to None by a hook on that parameter; ``step``/``zero_grad`` are no-ops (the
    work happened in backward). ``optimizers`` lists them (their state is the model's
    optimizer state)."""

    def __init__(self, params: Iterable[nn.Parameter],
                 make: Callable[[list], torch.optim.Optimizer]):
        self.optimizers = []
        for param in params:
            if param.requires_grad:
                optimizer = make([param])
                self.optimizers.append(optimizer)
                param.register_post_accumulate_grad_hook(_stepper(optimizer))

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to clear: each gradient was freed after its parameter's step."""

    def step(self) -> None:
        """Nothing left to step: each parameter stepped in backward."""


def _stepper(optimizer: torch.optim.Optimizer):
    def step_now(param: torch.Tensor) -> None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step_now
