"""Compile one rank's replay: from a trace, a config and its extensions to the program the op
loop runs (actors/replay/engine.py).

One step, in order: the trace's liveness, a compiled step per op, the memory accounting and
the tensor store, the extensions' plans (``attach``), the allocation policy, the memory guard
and the fast path, then the extensions' hooks and the ops they replay themselves. What the
loop needs is all in the returned ``Program``; nothing is planned later, except the
iteration's entries (actors/replay/iteration_sequence.py), built on first use.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from actors.errors import ReplayError
from actors.replay import iteration_sequence as sequence
from actors.replay import step_plan
from actors.replay.config import AllocationMode, ReplayConfig, parse_bytes
from actors.replay.extension_contract import ReplayContext, ReplayExtension
from actors.replay.memory.accounting import MemoryTracker, device_capacity
from actors.replay.memory.policies import make_policy
from actors.replay.memory.flush import Room
from actors.replay.memory.tensor_store import TensorStore
from actors.replay.ops import resolve
from actors.replay.ops.meta_outputs import RecordedOutputs
from actors.replay.ops.op_call import OpCaller
from actors.replay.step_plan import Step
from actors.trace.autograd_lifetimes import hold_checkpoint_inputs, hold_node_inputs
from actors.trace.collective_lifetimes import hold_collective_inputs
from actors.trace.optimizer_lifetimes import hold_gradients_through_step
from actors.trace.categories import storage_categories
from actors.trace.fsdp2_lifetimes import (hold_forward_all_gather_outputs,
                                          hold_reduce_scatter_inputs, hold_unsharded_parameters)
from actors.trace.liveness import compute_liveness
from actors.trace.recorded_frees import hold_recorded_frees, released
from actors.trace.model import Trace


def pick_device(name: str, index: int | None = None) -> torch.device:
    """auto -> cuda when available, else cpu; cuda takes ``index`` (the rank's device among
    the node's visible ones) or the current device."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ReplayError("replay.device=cuda but this rank sees no CUDA device")
        return torch.device("cuda", torch.cuda.current_device() if index is None else index)
    return torch.device(name)


@dataclass
class Program:
    """What the op loop runs: the compiled steps, the facilities they run against (``ctx``:
    memory, store, policy, extensions) and the loop's memory limits."""

    ctx: ReplayContext
    steps: list[Step]
    sequences: sequence.Sequences  # an iteration's entries (steps, hooks, frees)
    room: Room  # flushes and OOMs before an op that may not fit
    calls: OpCaller  # ops off the fast path, and output checks
    recorded: RecordedOutputs | None  # meta: recorded outputs replace kernels after probing


def compile_program(trace: Trace, cfg: ReplayConfig, device: torch.device, rank: int,
                    comm, extensions: list[ReplayExtension]) -> Program:
    """Compile ``trace`` for ``device`` and plan ``extensions`` (attached in order) into it.
    On failure every extension is closed (a meter gives torch its allocator back)."""
    if device.type == "cpu":
        # Synthetic data fed through optimizers decays into denormals, which slow CPU math
        # by 100x and would distort timings; the original run's real data has none.
        torch.set_flush_denormal(True)
    live = compute_liveness(trace.ops, trace.num_storages)
    if cfg.allocation.mode == AllocationMode.faithful:
        # storages the original held past their last use in the trace (lazy stays the
        # trace's liveness bound)
        hold_reduce_scatter_inputs(trace.ops, live)  # FSDP2 keeps them a module longer
        hold_unsharded_parameters(trace.ops, live)  # FSDP2 frees them when it reshards
        hold_forward_all_gather_outputs(trace.ops, live)  # ... until the next copy-out
        hold_checkpoint_inputs(trace.ops, live)  # the checkpoint frame keeps them
        hold_node_inputs(trace.ops, live)  # a backward node releases them when it returns
        hold_gradients_through_step(trace.ops, live)  # .grad lives until zero_grad
        hold_collective_inputs(trace.ops, live)  # async work keeps them until its wait
        hold_recorded_frees(trace.recorded_frees, live)  # the run's own frees, where recorded
    steps = [step_plan.compile_step(op, device, cfg.mode) for op in trace.ops]
    if all(s.reason == "out of scope" for s in steps):
        raise ReplayError(f"rank {rank}: {trace.path} has no op in scope for "
                          f"replay.mode={cfg.mode} ({len(trace.ops)} ops in the trace)")
    capacity = parse_bytes(cfg.device_memory_capacity) if cfg.device_memory_capacity else None
    memory = MemoryTracker(trace.num_storages, device_capacity(device, capacity),
                           cfg.timeline_max_points)
    memory.categories = storage_categories(trace, live)
    ranges = step_plan.index_ranges(steps)
    step_plan.add_guards(steps, ranges, live.storage_external)
    store = TensorStore(trace.num_tensors, live, memory, device, resolve.torch_dtype, ranges)
    ctx = ReplayContext(trace, cfg, device, rank, live, memory, store, comm, list(extensions))
    try:
        return _plan(ctx, steps)
    except BaseException:
        for ext in ctx.extensions:
            ext.close()
        raise


def _plan(ctx: ReplayContext, steps: list[Step]) -> Program:
    """The extensions' plans, the policy, the guard and the fast path (``compile_program``'s
    second half: what the extensions own shapes the rest)."""
    cfg, live, memory, store = ctx.cfg, ctx.liveness, ctx.memory, ctx.store
    for ext in ctx.extensions:  # the memory meter first: it measures what the others allocate
        ext.attach(ctx)
    owned = set().union(*(ext.owned_storages() for ext in ctx.extensions))
    used = {t.suid for s in steps if s.kind in ("compute", "collective")
            for t in s.op.input_tensors() if t.suid >= 0}
    ctx.policy = policy = make_policy(cfg.allocation.mode, live, used, owned,
                                      ctx.trace.made_inside, released(ctx.trace.recorded_frees))
    store.pinned = policy.persistent
    store.owned = frozenset(owned)
    step_plan.set_touch(steps, live.storage_bytes, owned)
    threshold = cfg.allocation.device_memory_threshold
    if threshold < 1 and memory.capacity_bytes is None:
        raise ReplayError("replay.allocation.device_memory_threshold needs a device capacity: "
                          f"set replay.device_memory_capacity for device {ctx.device.type}")
    flush_bytes = threshold * memory.capacity_bytes if threshold < 1 else None
    room = Room(memory, store, live.storage_bytes, flush_bytes,
                partial(_settle_all, tuple(ctx.extensions)))
    step_plan.set_fast_path(steps, live, room.guard, policy.persistent | owned, store.gather,
                           store.constant)
    hooks = sequence.merge_hooks([ext.hooks() for ext in ctx.extensions])
    for ext in ctx.extensions:  # ops an extension replays itself run its callable
        for index, run in ext.runs().items():
            steps[index].fn = run
    for step in steps:
        if step.kind == "collective" and step.fn is None:  # build_extensions refuses this
            raise ReplayError(f"rank {ctx.rank}: no extension replays collective op "
                              f"{step.op.index} ({step.op.name})")
    sequences = sequence.Sequences(steps, policy.free_lists, hooks, memory, store.gather)
    calls = OpCaller(store, owned, cfg.strict, ctx.rank, memory, ctx.device.type == "meta",
                     sequences.clear)
    # meta: the first iteration probes the kernels, later ones rebuild their outputs
    recorded = RecordedOutputs(steps) \
        if ctx.device.type == "meta" and cfg.meta_recorded_outputs else None
    if recorded is not None:
        recorded.probe()
    return Program(ctx, steps, sequences, room, calls, recorded)


def _settle_all(extensions: tuple) -> None:
    """Outstanding asynchronous work of every extension completes (before a flush)."""
    for ext in extensions:
        ext.settle()
