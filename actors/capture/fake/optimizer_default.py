"""torch.optim's default implementation as a GPU target picks it.

An optimizer built with neither ``foreach`` nor ``fused`` (``torch.optim.AdamW(params)``, what
most steps write) asks ``torch.optim.optimizer._default_to_fused_or_foreach`` which to run: the
multi-tensor ``foreach`` one when every parameter is a plain tensor on a device with foreach
kernels (CUDA), the single-tensor for-loop otherwise (the CPU). The two keep different bytes:
foreach AdamW makes whole lists at once (``_foreach_sqrt`` of every second moment: one more
copy of the parameters, alive until the update ends), the for-loop one parameter's
temporaries at a time. Fake tensors report ``cpu``, so without this a GPU target's trace holds
the CPU's choice. Within :func:`optimizers_as_on_cuda`, the choice for fake tensors is the one
torch makes for CUDA tensors of the same types; real tensors keep the CPU's.
"""
from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Callable

import torch
from torch._subclasses.fake_tensor import FakeTensor, is_fake
from torch.optim import optimizer as optim_base

_DEFAULT = "_default_to_fused_or_foreach"


def _as_on_cuda(cpu_default: Callable, on_choice: Callable[[str, int], None]) -> Callable:
    def default(params, differentiable, use_fused=False):
        if not any(p is not None and is_fake(p) for p in params):
            return cpu_default(params, differentiable, use_fused)
        if torch.jit.is_scripting() or differentiable:
            return False, False
        # a fake parameter stands for a CUDA tensor of torch's own types
        supported = (*optim_base._foreach_supported_types, FakeTensor)
        fused = use_fused and all(p is None or (type(p) in supported and p.is_floating_point())
                                  for p in params)
        foreach = not fused and all(p is None or type(p) in supported for p in params)
        on_choice("fused" if fused else "foreach" if foreach else "for-loop", len(params))
        return fused, foreach
    return default


@contextmanager
def optimizers_as_on_cuda(on_choice: Callable[[str, int], None]):
    """Within the block, torch.optim's optimizers left to their default pick their
    implementation for fake tensors as on CUDA; ``on_choice(implementation, num_params)`` is
    called with each choice."""
    cpu_default = getattr(optim_base, _DEFAULT)
    # every torch.optim module binds the function by name at import
    modules = [m for name, m in list(sys.modules.items())
               if (name == "torch.optim" or name.startswith("torch.optim."))
               and getattr(m, _DEFAULT, None) is cpu_default]
    patched = _as_on_cuda(cpu_default, on_choice)
    for module in modules:
        setattr(module, _DEFAULT, patched)
    try:
        yield
    finally:
        for module in modules:
            setattr(module, _DEFAULT, cpu_default)
