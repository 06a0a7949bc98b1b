"""Backward markers for modules whose output torch's full backward hooks cannot see into.

``register_full_backward_pre_hook`` / ``register_full_backward_hook`` reach a module's
backward through its output, and torch wraps the output only when it is a Tensor or a tuple
of Tensors. A module returning a Hugging Face ``ModelOutput`` (``Qwen2Model``,
``LlamaModel``: every HF base model), a dict or a list gets a warning per call ("module output
should be a Tensor or a tuple of Tensors") and hooks that never fire: its
``## module_bwd_begin/end ##`` markers were missing.

:func:`container_output_markers` is a forward hook doing for such an output what torch does
for a tuple, on the tensors inside it (``torch.utils._pytree``, where transformers registers
``ModelOutput``): ``begin`` once the gradients of all of them are computed (the moment torch's
full backward pre hook fires), ``end`` once those of the module's inputs that require grad are
(its full backward hook; right after ``begin`` when no input requires grad, as torch then
fires it). An output torch does see (a Tensor, a tuple holding one) is left to torch's hooks.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_leaves


def _grad_tensors(tree) -> list[torch.Tensor]:
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor) and t.requires_grad]


def _torch_sees(output) -> bool:
    """Whether torch's own backward hooks wrap this output (module._call_impl's rule)."""
    return isinstance(output, torch.Tensor) or (
        isinstance(output, tuple) and any(isinstance(o, torch.Tensor) for o in output))


def container_output_markers(begin: Callable[[], None], end: Callable[[], None]) -> Callable:
    """A forward hook (``register_forward_hook(..., with_kwargs=True)``) calling ``begin`` and
    ``end`` at the module's backward, for an output torch's hooks do not see (module doc)."""
    def hook(module, args, kwargs, output):
        if _torch_sees(output):
            return None
        outputs = _grad_tensors(output)
        if not outputs:
            return None
        inputs = _grad_tensors((args, kwargs))

        def on_outputs(_grads):
            begin()
            if not inputs:
                end()

        register_multi_grad_hook(outputs, on_outputs, mode="all")
        if inputs:
            register_multi_grad_hook(inputs, lambda _grads: end(), mode="all")
        return None
    return hook
