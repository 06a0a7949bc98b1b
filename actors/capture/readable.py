"""Whether a tensor's values can be read, asked by workloads whose shapes follow their data (an
MoE's tokens per expert) instead of the device they run on: a real tensor's can, a meta tensor's
cannot, a fake tensor's can when the fake device knows them (it keeps them under
:data:`VALUE_ATTR`: actors/capture/fake/fake_values.py)."""
from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake

VALUE_ATTR = "_tracefleet_value"  # a fake tensor's real value (a cpu tensor), when known


def value_of(t) -> torch.Tensor | None:
    """The real value of fake tensor ``t`` when it is known, else None."""
    return getattr(t, VALUE_ATTR, None)


def readable(t: torch.Tensor) -> bool:
    """Whether ``t``'s values can be read (``tolist()``, ``item()``)."""
    return t.device.type != "meta" and (not is_fake(t) or value_of(t) is not None)
