"""A step's own activation offloading, ``torch.autograd.graph.save_on_cpu``, as on a GPU.

On a GPU, save_on_cpu copies every tensor autograd saves into host memory as forward saves it
and copies it back to the device when backward needs it (``offload_wrapper`` of
torch.distributed's checkpoint wrappers does the same per module). The device then holds only
what forward still computes with. On fake tensors, which report ``cpu``, its hooks would copy
each saved tensor to "the host" that is the same device, and its unpack returns that copy
itself, so a GPU target's prediction held every saved tensor on the device.

Within :func:`save_on_cpu_as_on_gpu` (a GPU target), a save_on_cpu region packs with a host
copy that is named as host memory in the trace (a ``tracefleet::host_storage`` op:
actors/trace/conventions.py), which the prediction counts as host bytes, not the device's; its
unpack makes a new device tensor, as a copy from the host does. Only what the region saved is
named: the tensors saved outside it stay on the device.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable

import torch
from torch.autograd.graph import save_on_cpu, saved_tensors_hooks

from actors.capture.fake.marker_ops import marker_op, write
from actors.trace.conventions import HOST_STORAGE_OP


def host_copy(tensor: torch.Tensor) -> tuple[torch.device, torch.Tensor]:
    """save_on_cpu's pack: ``tensor``'s device and its copy in (pinned, from CUDA) host
    memory."""
    host = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout, device="cpu",
                       pin_memory=tensor.device.type == "cuda")
    host.copy_(tensor)
    return tensor.device, host


def copy_back(packed) -> torch.Tensor:
    """The unpack: always a new tensor on the device, as ``.to("cuda")`` of a host tensor is
    (save_on_cpu's ``.to`` of a cpu tensor to the cpu would return the host copy itself)."""
    device, host = packed
    return host.to(device, non_blocking=True, copy=True)


def _named_pack(on_copy: Callable[[int], None]):
    def pack(tensor: torch.Tensor):
        device, host = host_copy(tensor)
        write(marker_op(HOST_STORAGE_OP, "Tensor[] storages"), [host])
        on_copy(host.numel() * host.element_size())
        return device, host
    return pack


@contextmanager
def save_on_cpu_as_on_gpu(on_copy: Callable[[int], None]):
    """Within the block, ``save_on_cpu`` regions keep their copies in host memory as on a GPU
    (module doc); ``on_copy(nbytes)`` is called with each copy."""
    gpu_init = save_on_cpu.__init__

    def init(self, pin_memory: bool = False, device_type: str = "cuda") -> None:
        saved_tensors_hooks.__init__(self, _named_pack(on_copy), copy_back)

    save_on_cpu.__init__ = init
    try:
        yield
    finally:
        save_on_cpu.__init__ = gpu_init
