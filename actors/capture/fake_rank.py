"""Record one rank of a ``workload.device=meta`` or ``fake`` world in this process: torch's
fake process group, the model built on meta or inside :class:`actors.capture.fake.fake_mode.
CaptureFakeMode`, warm-ups until nothing changes between iterations (settle), then one recorded
iteration. The world around it (which ranks are recorded, which files written) is
meta_world.py's for a 1-D job and mesh_world.py's for an N-D mesh.
"""
from __future__ import annotations

import os
import sys
from contextlib import contextmanager, nullcontext
from unittest import mock
from functools import partial

import torch
import torch.distributed as dist

from actors.launcher_env import launcher_environment
from actors.trace.conventions import trace_file_name
from actors.capture.fake import free_markers
from actors.capture.fake.cuda_dispatch import cuda_kernels
from actors.capture.fake.deepspeed_ops import no_shm_comm_build
from actors.capture.fake.fake_ddp import ddp_on_fake
from actors.capture.fake.compiled_on_fake import inductor_on_fake, num_compiled_graphs
from actors.capture.fake.fake_idioms import fake_step_error, torch_idioms_on_fake
from actors.capture.fake.fake_mode import (CaptureFakeMode, ranges_outside_fake_mode,
                                           strip_dispatch_mode_nodes)
from actors.capture.fake.fake_reducer import rebuild_pending
from actors.capture.fake.fake_values import known_values_look_real
from actors.capture.fake.meta_storage import unique_meta_storages
from actors.capture.recorder import record_iteration
from actors.errors import ConfigError
from actors.capture.request import CaptureRequest
from actors.capture.workloads.context import Workload, world_mesh
from actors.capture.workloads.build import build_workload

META = torch.device("meta")
GPUS_PER_NODE = 8  # a fake world's ranks are placed so (LOCAL_RANK, NODE_RANK)
WARMUP_ITERS = 1  # only creates the optimizer state: nothing else warms up on meta or fake
# ...but DDP's reducer rebuilds its buckets once, at the forward after the first reducing
# iteration (static_graph: after the second), and torch.compile recompiles when a guard fails
# (gradients that exist from the second step on): warm-ups until neither happens, at most these.
MAX_SETTLE_ITERS = 3
FAKE_MEMORY_METHOD = "not measured: fake tensors allocate nothing"


@contextmanager
def _shapes_only(device: str, world_size: int):
    """Yield ``(torch device, mesh, fake mode or None)`` with the fake tensor mode entered on
    fake."""
    if device != "fake":
        yield META, None, None
        return
    mesh = world_mesh("cpu", world_size)  # before the mode: see world_mesh
    with fake_tensors(CaptureFakeMode()) as mode:
        yield torch.device("cpu"), mesh, mode


@contextmanager
def fake_tensors(mode: CaptureFakeMode):
    """Within the block, ``mode`` is entered with what the fake device needs around it:
    ranges below its dispatch, DDP's stand-in reducer, torch's idioms on fake tensors, no
    DeepSpeed comm op built."""
    with inductor_on_fake(), ranges_outside_fake_mode(), ddp_on_fake(), torch_idioms_on_fake(), \
            no_shm_comm_build(), mode:
        yield mode


@contextmanager
def fake_errors(device: str):
    """Within the block, what fake cannot do raises a ConfigError saying what and where."""
    try:
        yield
    except Exception as e:
        error = fake_step_error(e) if device == "fake" else None
        if error is None:
            raise
        raise error from e


def record_workload(workload: Workload, request: CaptureRequest, path: str,
                    mode: CaptureFakeMode | None, step=None, rewrite=None) -> None:
    """Warm ``workload`` (``request``'s) up to its steady state and record one iteration into
    ``path``: on fake
    (``mode``) with the libraries' fakeness predicates answered where values are known, the
    run's frees written and the trace rewritten (``rewrite``, default
    strip_dispatch_mode_nodes); ``step`` replaces the workload's step for the recorded
    iteration only. With ``workload.gpu_kernels`` set, SDPA runs the GPU's kernels
    (actors/capture/fake/cuda_dispatch.py) and ``workload.info["kernel_dispatch"]`` says which. Call
    after build(): the user's code has imported its libraries."""
    fake = mode is not None
    with known_values_look_real() if fake else nullcontext(), \
            cuda_kernels(request.workload.gpu_kernels) as dispatched:
        num_warmup = settle(workload)
        if dispatched is not None:  # the recorded iteration's calls only
            dispatched.clear()
        graphs = num_compiled_graphs()
        record_iteration(step or workload.step, workload.next_batch(), workload.model,
                         step_index=num_warmup, out_path=path,
                         module_backward=request.module_backward_ranges,
                         tensor_ranges=False,
                         rewrite=(rewrite or strip_dispatch_mode_nodes) if fake else None,
                         around_step=partial(free_markers.recording, mode) if fake else None)
        if num_compiled_graphs() != graphs:
            raise ConfigError(
                f"workload.device={request.workload.device}: torch.compile compiled again in "
                f"the recorded iteration, after {num_warmup} warm-up iterations: the step "
                "recompiles every iteration (a guard fails each time: a Python number or shape "
                "that changes per step); the trace would hold the compiler's own ops. Make the "
                "changing value a tensor or mark it dynamic (torch._dynamo.mark_dynamic), or "
                "capture without torch.compile")
    if dispatched is not None:
        workload.info["kernel_dispatch"] = dispatched.summary()


def settle(workload: Workload) -> int:
    """Warm ``workload`` up until the recorded iteration is the steady state a real capture
    records (the optimizer state exists, DDP's buckets are rebuilt, torch.compile compiled
    every graph the step runs: a compilation inside the recorded iteration would record the
    compiler's own ops); the number run. Each runs the workload's ``warm_step`` where it has
    one (a pipeline stage's one micro-batch)."""
    step = workload.warm_step or workload.step
    graphs = num_compiled_graphs()
    for _ in range(WARMUP_ITERS):
        step(workload.next_batch())
    num = WARMUP_ITERS
    while (rebuild_pending() or num_compiled_graphs() != graphs) \
            and num < WARMUP_ITERS + MAX_SETTLE_ITERS:
        graphs = num_compiled_graphs()
        step(workload.next_batch())
        num += 1
    return num


def rank_environment(rank: int, world_size: int) -> dict[str, str]:
    """torch's launcher variables as the rank would see them (a user's step or its library may
    read them: DeepSpeed's engine asserts LOCAL_RANK), ranks placed GPUS_PER_NODE to a node;
    DeepSpeed's accelerator is the CPU's unless the user chose one."""
    local_world = min(world_size, GPUS_PER_NODE)
    return {**launcher_environment(rank, rank % local_world, world_size, local_world,
                                   rank // local_world),
            "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu")}


def record_meta_rank(request: CaptureRequest, out_dir: str, rank: int,
                     world_size: int) -> tuple[Workload, str]:
    """Record rank ``rank`` of ``request``'s meta or fake world into out_dir; ``(workload,
    trace path)``."""
    # Imported here: importing it registers the "fake" backend with torch.distributed.
    from torch.testing._internal.distributed.fake_pg import FakeStore

    wl_cfg = request.workload
    path = os.path.join(out_dir, trace_file_name(rank))
    # Fake tensors are backed by meta ones: their storages need distinct addresses too.
    with unique_meta_storages(), mock.patch.dict(os.environ, rank_environment(rank, world_size)):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
        try:
            with fake_errors(str(wl_cfg.device)), \
                    _shapes_only(str(wl_cfg.device), world_size) as (device, mesh, mode):
                workload = build_workload(wl_cfg, rank, world_size, device, mesh)
                record_workload(workload, request, path, mode)
        finally:
            dist.destroy_process_group()
            _forget_deepspeed_groups()
    return workload, path


def _forget_deepspeed_groups() -> None:
    """DeepSpeed keeps the process groups it adopted in module globals; the next rank's capture
    in this process brings a new default group, which a kept one would not be registered in
    (``deepspeed.initialize`` fails: "Group ... is not registered")."""
    groups = sys.modules.get("deepspeed.utils.groups")
    if groups is not None:
        for name, value in list(vars(groups).items()):
            if name.startswith("_") and "GROUP" in name and not isinstance(value, (str, int)):
                setattr(groups, name, {} if isinstance(value, dict) else None)
        groups.mpu = groups.mesh_device = None
    comm = sys.modules.get("deepspeed.comm.comm")
    if comm is not None:
        comm.cdb = None
