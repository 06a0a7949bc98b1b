"""What a workload builder is given (``CaptureContext``, for a custom step's ``build(ctx)``,
actors/capture/workloads/custom.py) and what every builder returns (``Workload``,
actors/capture/workloads/build.py); below both builders, so neither imports the other for it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass(frozen=True)
class CaptureContext:
    """One rank's place in the capture; the default process group is initialized already."""

    device: torch.device  # where the model and batches live (cpu, cuda:<local rank>; on
    # workload.device=fake: cpu, inside the fake tensor mode)
    rank: int  # this rank, 0..world_size-1 (on fake: the recorded rank, 0)
    world_size: int  # number of ranks training together (on fake: any number)
    # 1-D over all ranks on device.type (FSDP2's ``mesh=``); with workload.parallelism beyond
    # dp_shard, the job's named N-D mesh (actors/capture/workloads/mesh.py: ctx.mesh["tp"], ...)
    mesh: DeviceMesh

    def parallelizing(self):
        """Wrap ``parallelize_module`` / ``fully_shard`` calls on an N-D mesh in it: on fake they
        slice the mesh, which must run outside the fake tensor mode (``aten.nonzero`` has no
        fake kernel); the parameters stay fake. Nothing on a real device."""
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        return unset_fake_temporarily()


@dataclass
class Workload:
    """A built workload on one rank."""

    model: nn.Module  # the plain model (DeepSpeed's engine wraps it; hooks go here)
    step: Callable[[tuple], None]  # one training iteration on a batch
    # A batch: grad_accum_steps micro-batches (idx, targets), from the rank's own generator.
    next_batch: Callable[[], tuple]
    num_params: int  # parameters of the full (unpartitioned) model
    info: dict  # extra facts for meta.json (e.g. the DeepSpeed version)
    # A cheaper iteration for the shapes-only warm-ups (actors/capture/fake_rank.py's settle)
    # that leaves the state ``step`` starts from in a steady run: a pipeline stage's one
    # micro-batch (actors/capture/workloads/parallelize/pipeline.py). None: ``step``.
    warm_step: Callable[[tuple], None] | None = None


def world_mesh(device_type: str, world_size: int) -> DeviceMesh:
    """The 1-D mesh over every rank of the default process group (whose group it reuses).

    On fake, call it before entering the fake tensor mode: the mesh's rank tensor must be
    real (inside the mode, mesh creation fails reading it back).
    """
    return init_device_mesh(device_type, (world_size,))
