"""What a custom training step's ``build(ctx)`` is given (see actors/capture/custom.py)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass(frozen=True)
class CaptureContext:
    """One rank's place in the capture; the default process group is initialized already."""

    device: torch.device  # where the model and batches live (cpu, cuda:<local rank>; on
    # workload.device=fake: cpu, inside the fake tensor mode)
    rank: int  # this rank, 0..world_size-1 (on fake: the recorded rank, 0)
    world_size: int  # number of ranks training together (on fake: any number)
    mesh: DeviceMesh  # 1-D, over all ranks, on device.type (FSDP2's ``mesh=``)


def world_mesh(device_type: str, world_size: int) -> DeviceMesh:
    """The 1-D mesh over every rank of the default process group (whose group it reuses).

    On fake, call it before entering the fake tensor mode: the mesh's rank tensor must be
    real (inside the mode, mesh creation fails reading it back).
    """
    return init_device_mesh(device_type, (world_size,))
