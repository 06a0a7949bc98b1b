"""Activation offloading to the host (``workload.activation_offload``), as
``torch.autograd.graph.save_on_cpu(pin_memory=True)`` does it: every tensor autograd saves for
backward is copied into host memory as forward saves it, and copied back to the device when
backward needs it; the device keeps only what forward is still computing with.

The hooks are save_on_cpu's as a GPU target's capture runs a step's own region
(actors/capture/fake/host_copies.py: ``host_copy``, ``copy_back``): backward's copy back is
always a new tensor, as ``.to("cuda")`` of a host tensor is, where save_on_cpu's ``.to`` of a
cpu tensor to the cpu would return the host copy itself. tracefleet-predict counts the host
copies (the trace's ``activations``: made in forward, used in backward) as host memory
(orchestrator/studies/predict.py), and the copies back as the device's, alive while their
backward node runs.
"""
from __future__ import annotations

from contextlib import nullcontext

import torch

from actors.capture.fake.host_copies import copy_back, host_copy


def offloading(cfg):
    """The context a forward runs in: activations saved to the host when
    ``cfg.activation_offload`` (a WorkloadConfig's), else nothing."""
    if not getattr(cfg, "activation_offload", False):
        return nullcontext()
    return torch.autograd.graph.saved_tensors_hooks(host_copy, copy_back)
