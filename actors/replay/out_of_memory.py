"""An out-of-memory outcome of a replay: the accounted capacity crossed before an op runs
(actors/replay/memory/accounting.py) or the device refusing a real allocation while it runs
(actors/replay/ops/op_call.py); the rank reports it as an OOM, not as a failed replay."""
from __future__ import annotations

import torch


class OutOfMemory(Exception):
    """An op's request would cross the device capacity, or a real allocation failed."""

    def __init__(self, held_bytes: int, requested_bytes: int, capacity_bytes: int | None,
                 message: str | None = None):
        super().__init__(message or f"need {requested_bytes} B more with {held_bytes} B held; "
                                    f"capacity {capacity_bytes} B")
        self.held_bytes = held_bytes
        self.requested_bytes = requested_bytes
        self.capacity_bytes = capacity_bytes
        self.message = message

    def __reduce__(self):  # the custom __init__ needs its own arguments to unpickle
        return type(self), (self.held_bytes, self.requested_bytes, self.capacity_bytes,
                            self.message)


# What torch raises when the host allocator fails (torch 2.x wording: "DefaultCPUAllocator:
# can't allocate memory" / "not enough memory"); CUDA raises torch.OutOfMemoryError.
_CPU_ALLOC_FAILURE = ("DefaultCPUAllocator", "can't allocate memory", "not enough memory")


def is_allocation_failure(error: BaseException) -> bool:
    """Whether ``error`` is the device refusing memory (an OOM), not a replay problem."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    return isinstance(error, RuntimeError) and any(s in str(error) for s in _CPU_ALLOC_FAILURE)
