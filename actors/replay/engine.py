"""The op loop of one rank: iterations, memory (policy, guard, flush, OOM), timing, report.

The loop runs a precomputed sequence (actors/replay/sequence.py): compiled ops, extension
hooks (ZeRO-3 fetch/release, host gaps, async collectives' completion) and the allocation
policy's frees after each op. It never branches on the allocation mode or on an extension:
they are planned into the sequence once.
"""
from __future__ import annotations

import time
import weakref
from itertools import islice

import torch

from actors.errors import ReplayError
from actors.gc_pause import gc_paused
from actors.replay import plan as planning
from actors.replay import resolve, sequence, standins
from actors.replay.allocation import make_policy
from actors.replay.config import AllocationMode, ReplayConfig, parse_bytes
from actors.replay.host_gaps import HostGaps
from actors.replay.nested_memory import NestedMemory
from actors.replay.memory import (MemoryTracker, OutOfMemory, device_capacity,
                                  is_allocation_failure, sample_points)
from actors.replay.meta_outputs import RecordedOutputs
from actors.replay.meters import make_meter
from actors.replay.op_call import OpCaller
from actors.replay.report import RankReport
from actors.replay.tensor_store import TensorStore
from actors.replay.timed_iterations import StopRule, world_max
from actors.trace.autograd_lifetimes import hold_checkpoint_inputs, hold_node_inputs
from actors.trace.categories import storage_categories
from actors.trace.fsdp2_lifetimes import (hold_forward_all_gather_outputs,
                                          hold_reduce_scatter_inputs, hold_unsharded_parameters)
from actors.trace.liveness import compute_liveness
from actors.trace.model import Trace

# What a replayed op may raise on synthetic data; the op is then skipped with its reason
# (unless it is the device refusing memory: that is an OOM).
_OP_ERRORS = (RuntimeError, TypeError, ValueError, IndexError, NotImplementedError)


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


class _Flushed(Exception):
    """A flush dropped storages the fast sequence assumes held: continue at ``position`` in
    the checked sequence."""

    def __init__(self, position: int):
        super().__init__(position)
        self.position = position


class ReplayEngine:
    """Replays one rank's trace. Collectives go to ``comm`` (a CollectiveReplayer) when given;
    ``extensions`` (ReplayExtension) join the loop at the points they plan."""

    def __init__(self, trace: Trace, cfg: ReplayConfig, device: torch.device | None = None,
                 comm=None, rank: int = 0, progress=None, extensions=()):
        with gc_paused():  # a step per op and the plan's tables: no cycles (gc_pause.py)
            self._setup(trace, cfg, device, comm, rank, progress, extensions)

    def _setup(self, trace, cfg, device, comm, rank, progress, extensions) -> None:
        """The engine's state (``__init__``'s body)."""
        cfg.validate()
        self.trace = trace
        self.cfg = cfg
        self.device = device or pick_device(cfg.device)
        if self.device.type == "cpu":
            # Synthetic data fed through optimizers decays into denormals, which slow CPU math
            # by 100x and would distort timings; the original run's real data has none.
            torch.set_flush_denormal(True)
        self.comm = comm
        self.rank = rank
        self.progress = progress  # callable(iteration, num_iterations) or None
        if cfg.mode != "compute" and comm is None and any(op.collective for op in trace.ops):
            raise ReplayError(f"replay.mode={cfg.mode} needs process groups; this engine has none "
                              "(use replay.mode=compute for a single-process replay)")
        self.liveness = live = compute_liveness(trace.ops, trace.num_storages)
        if cfg.allocation.mode == AllocationMode.faithful:
            # storages the original held past their last use in the trace (lazy stays the
            # trace's liveness bound)
            hold_reduce_scatter_inputs(trace.ops, live)  # FSDP2 keeps them a module longer
            hold_unsharded_parameters(trace.ops, live)  # FSDP2 frees them when it reshards
            hold_forward_all_gather_outputs(trace.ops, live)  # ... until the next copy-out
            hold_checkpoint_inputs(trace.ops, live)  # the checkpoint frame keeps them
            hold_node_inputs(trace.ops, live)  # a backward node releases them when it returns
        self.steps = [planning.compile_step(op, self.device, cfg.mode) for op in trace.ops]
        if all(s.reason == "out of scope" for s in self.steps):
            raise ReplayError(f"rank {rank}: {trace.path} has no op in scope for "
                              f"replay.mode={cfg.mode} ({len(trace.ops)} ops in the trace)")
        capacity = parse_bytes(cfg.device_memory_capacity) if cfg.device_memory_capacity else None
        self.memory = MemoryTracker(trace.num_storages, device_capacity(self.device, capacity),
                                    cfg.timeline_max_points)
        self.memory.categories = storage_categories(trace, live)
        ranges = planning.index_ranges(self.steps)
        planning.add_guards(self.steps, ranges, live.storage_external)
        self.store = TensorStore(trace.num_tensors, live, self.memory, self.device,
                                 resolve.torch_dtype, ranges)
        self.extensions = list(extensions)
        if cfg.host_gaps:
            self.extensions.append(HostGaps.for_trace(trace))
        if trace.nested_lifetimes and cfg.allocation.mode == AllocationMode.faithful:
            self.extensions.append(NestedMemory(trace.nested_lifetimes))
        # measure from before anything of the replay exists (extensions allocate in attach),
        # until close() or until the engine is collected (a CPU meter wraps torch's allocator)
        self.meter = make_meter(self.device, cfg.measure_memory)
        self.meter.open()
        self._close_meter = weakref.finalize(self, self.meter.close)
        try:
            self._attach(cfg)
        except BaseException:
            self.close()
            raise

    def _attach(self, cfg: ReplayConfig) -> None:
        """Extensions, the allocation policy, guards and hooks (the rest of ``__init__``)."""
        trace, live = self.trace, self.liveness
        for ext in self.extensions:
            ext.attach(self)
        owned = set().union(*(ext.owned_storages() for ext in self.extensions))
        used = {t.suid for s in self.steps if s.kind in ("compute", "collective")
                for t in s.op.input_tensors() if t.suid >= 0}
        self.policy = make_policy(cfg.allocation.mode, live, used, owned, trace.made_inside)
        self.store.pinned = self.policy.persistent
        self.store.owned = frozenset(owned)
        planning.set_touch(self.steps, live.storage_bytes, owned)
        threshold = cfg.allocation.device_memory_threshold
        if threshold < 1 and self.memory.capacity_bytes is None:
            raise ReplayError("replay.allocation.device_memory_threshold needs a device capacity: "
                              f"set replay.device_memory_capacity for device {self.device.type}")
        self.flush_bytes = threshold * self.memory.capacity_bytes if threshold < 1 else None
        limits = [x for x in (self.flush_bytes, self.memory.capacity_bytes) if x is not None]
        self.guard = min(limits) if limits else float("inf")
        planning.set_fast_path(self.steps, live, self.guard, self.policy.persistent | owned,
                               self.store.gather, self.store.constant)
        hooks = [ext.hooks() for ext in self.extensions]
        if self.comm is not None:  # async collectives complete before the first op using
            hooks.append((self.comm.hooks(), {}))  # them, after a host gap there (a wait in it)
        self._hooks = sequence.merge_hooks(hooks)
        self._sequences: dict[tuple[bool, bool], list] = {}  # (sampled, checked) -> entries
        self.calls = OpCaller(self.store, owned, cfg.strict, self.rank)
        self.num_flushes = 0
        self.flushed_bytes = 0
        self.last_op = None
        self.num_iterations_run = 0  # completed iterations, warm-up included
        self.stop_index: int | None = None  # op index the replay stopped at (OOM, failure)
        self.stopped_in_hook = False  # ... in an extension's hook next to that op
        self.stop_rule: StopRule | None = None  # when timing stops (set by run())
        self._extensions_allocated = False  # ReplayExtension.allocate ran (in _prepare)
        # meta: the first iteration probes the kernels, later ones rebuild their outputs
        self.recorded = RecordedOutputs(self.steps) \
            if self.device.type == "meta" and cfg.meta_recorded_outputs else None
        if self.recorded is not None:
            self.recorded.probe()

    # --- the sequence ---------------------------------------------------------------------
    def sequence(self, sampled: bool, checked: bool) -> list[tuple]:
        """The entries of an iteration (sequence.build), built once per variant."""
        key = (sampled, checked)
        if key not in self._sequences:
            samples = set(sample_points(len(self.steps), self.memory.max_points)) \
                if sampled else set()
            self._sequences[key] = sequence.build(
                self.steps, self.policy.free_lists, self._hooks, samples, self.memory.sample,
                checked, self.store.gather)
        return self._sequences[key]

    # --- one op (slow paths; the fast path is inlined in _iteration) ----------------------
    def _make_room(self, step) -> bool:
        """Before an op that may not fit: flush when held + what the op needs would cross the
        threshold, then raise OutOfMemory if it still does not fit the capacity. Returns
        whether it flushed."""
        memory, sizes = self.memory, self.liveness.storage_bytes
        held = memory.held
        need = sum(sizes[s] for s in step.touch if not held[s])
        flushed = self.flush_bytes is not None and memory.held_bytes + need > self.flush_bytes
        if flushed:
            self._flush(step.op.index)
            need = sum(sizes[s] for s in step.touch if not held[s])  # flushed inputs return
        cap = memory.capacity_bytes
        if cap is not None and memory.held_bytes + need > cap:
            raise OutOfMemory(memory.held_bytes, need, cap)
        return flushed

    def _flush(self, op_index: int) -> None:
        """Drop every storage the policy lets go (outstanding collectives complete first)."""
        if self.comm is not None:
            self.comm.wait_all()
        freed = self.store.free_all()
        if freed and self.memory.recording:  # counted per iteration (they all flush alike);
            self.num_flushes += 1            # a flush that could drop nothing did not happen
            self.flushed_bytes += freed
            self.memory.note_flush(op_index)

    def _run_general(self, step, check: bool) -> None:
        """An op off the fast path (tensor lists, keyword tensors, index guards, several
        outputs)."""
        try:
            out = self.calls.call(step)
        except _OP_ERRORS as e:
            out = self._op_failed(step, e)
        if out is not None:
            self.calls.register(step.op, out, check)

    def _op_failed(self, step, e: Exception):
        """An op raised. An input a flush dropped (the fast path passes it as None, which a
        required argument refuses) is re-materialized and the op retried; the device refusing
        memory is an OOM; on meta, an op that needs values returns its recorded outputs from
        now on (a stand-in); anything else skips the op from now on, with its reason counted.
        Returns the op's outputs when the retry or the stand-in ran."""
        tensors = self.store.tensors
        if step.fast is not None and any(tensors[t.uid] is None for _, t in step.tensor_slots):
            try:
                return self.calls.call(step)
            except _OP_ERRORS as again:
                e = again
        if is_allocation_failure(e):
            raise OutOfMemory(self.memory.held_bytes, 0, self.memory.capacity_bytes,
                              f"{type(e).__name__}: {str(e).splitlines()[0][:300]}") from None
        standin = standins.fallback(step, e) if self.device.type == "meta" else None
        if standin is not None:  # needs values meta tensors do not have: the trace's outputs
            step.fn, step.fast = standin, None
            step.standin = f"needs values on meta: {str(e).splitlines()[0][:120]}"
            self._sequences.clear()
            return self.calls.call(step)
        step.kind = "failed"
        step.fast = None
        step.reason = f"error: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
        self._sequences.clear()  # rebuilt without its fast tuple before the next iteration
        return None

    # --- iterations ---------------------------------------------------------------------
    def _iteration(self) -> float:
        """Run the sequence once; returns the seconds spent issuing and waiting for collectives.

        Output shapes and dtypes are checked in the first iteration only: they follow from
        the input shapes, which do not change, so later checks would only cost time. After a
        flush the rest of the iteration runs the checked sequence (sequence.py).
        """
        comm = self.comm
        blocked_s = comm.blocked_s if comm is not None else 0.0
        for ext in self.extensions:
            ext.on_iteration_start()
        position, checked = 0, False
        while True:
            try:
                self._run(self.sequence(self.memory.recording, checked), position, checked)
                break
            except _Flushed as flushed:
                position, checked = flushed.position, True
        if comm is None:
            return 0.0
        comm.wait_all()
        return comm.blocked_s - blocked_s

    def _run(self, entries: list[tuple], start: int, checked: bool) -> None:
        """Run ``entries`` from ``start``; raises _Flushed when a flush happens while the
        fast (unchecked) entries run."""
        memory, store, calls = self.memory, self.store, self.calls
        categories, category_bytes = memory.categories, memory.category_bytes
        tensors, drop, held = store.tensors, store.drop, memory.held
        comm, guard = self.comm, self.guard
        get = store.get if self.cfg.mode == "full" else None
        check = self.num_iterations_run == 0
        timing = self.cfg.per_op_timing
        clock = time.perf_counter_ns
        step = None
        last = clock()
        try:
            for position, entry in enumerate(islice(entries, start, None), start):
                fn, getter, kwargs, out_uid, out_suid, out_bytes, limit, frees, step = entry
                memory.step = step
                if fn is not None:  # the common case, kept free of attribute lookups
                    if memory.held_bytes > limit and self._make_room(step) and not checked:
                        raise _Flushed(position)
                    try:
                        out = fn(*getter(tensors), **kwargs) if kwargs is not None \
                            else fn(*getter(tensors))
                    except _OP_ERRORS as e:
                        out = self._op_failed(step, e)
                        if out is not None:
                            calls.register(step.op, out, check)
                    else:
                        tensors[out_uid] = out
                        if out_bytes:  # a fresh storage (MemoryTracker.add, inlined)
                            held[out_suid] = out_bytes
                            memory.held_bytes += out_bytes
                            category_bytes[categories[out_suid]] += out_bytes
                            if memory.held_bytes > memory.high_bytes:
                                memory.high_bytes = memory.held_bytes
                            if memory.held_bytes > memory.peak_bytes:
                                memory.new_peak(step)
                        if check:
                            calls.check_single(step, out)
                    out = None  # a storage freed below must not live on in a local
                elif step.kind == "hook":
                    step.fn()
                elif step.kind in ("compute", "collective"):
                    if memory.held_bytes + step.touch_bytes > guard and \
                            self._make_room(step) and not checked:
                        raise _Flushed(position)
                    if step.kind == "compute":
                        self._run_general(step, check)
                    else:
                        comm.run(step.op, get)
                # skipped and failed ops still free the storages whose last use they were
                for s in frees:
                    drop(s)
                if timing:
                    now = clock()
                    step.time_ns += now - last
                    last = now
        except _Flushed:
            raise
        except BaseException:
            if step is not None:
                op = step.op if step.op is not None else self.trace.ops[step.at]
                self.stop_index, self.last_op = op.index, op
                self.stopped_in_hook = step.op is None
            raise
        finally:
            if step is not None and step.op is not None:
                self.last_op = step.op

    def _end_iteration(self, measured: bool) -> None:
        """Back to the persistent set; extensions release what they hold."""
        for ext in self.extensions:
            ext.on_iteration_end(measured)
        self.store.free_all()
        self.memory.recording = False
        if self.recorded is not None and self.num_iterations_run == 0:
            self.recorded.install()  # the kernels were probed: recipes from now on
            self._sequences.clear()
        self.num_iterations_run += 1

    def _prepare(self) -> None:
        """Allocate what extensions hold for the whole replay, then materialize the policy's
        persistent storages, before the first iteration (inside the memory meter's window:
        the measured peak must include everything the accounted one counts)."""
        if not self._extensions_allocated:  # once: a second run() reuses them
            self._extensions_allocated = True
            for ext in self.extensions:
                ext.allocate()
        persistent = self.policy.persistent
        if not persistent:
            return
        store = self.store
        for step in self.steps:
            if step.kind in ("compute", "collective"):
                for t in step.op.input_tensors():
                    if t.suid in persistent and store.tensors[t.uid] is None:
                        store.materialize(t)

    def _reset_timings(self) -> None:
        """Forget what an untimed (warm-up) iteration added to the timings."""
        for step in self.steps:
            step.time_ns = 0
        if self.comm is not None:
            self.comm.stats.reset()

    def run(self) -> RankReport:
        """Warm-up and measured iterations; OOM and failures become the report's status, and
        what was measured before them is kept. The cyclic GC pauses meanwhile: a collection
        rescans the trace's objects (seconds on a 70B trace) inside a timed iteration."""
        with gc_paused():
            return self._run_iterations()

    def _run_iterations(self) -> RankReport:
        """``run``'s body."""
        report = RankReport.start(self)
        cfg = self.cfg
        stop = StopRule(cfg.iters, cfg.min_time_s, cfg.ci_target, cfg.max_iters,
                        world_max(self.device) if self.comm is not None else None)
        self.stop_rule = stop
        num_iters = cfg.warmup_iters + stop.planned
        meter, window = self.meter, False
        try:
            self._prepare()
            for it in range(num_iters):
                measured = it >= cfg.warmup_iters
                if measured:
                    meter.start()
                    window = True
                t0 = time.perf_counter()
                comm_s = self._iteration()
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                elapsed = time.perf_counter() - t0
                if measured:
                    meter.stop()
                    window = False
                self._end_iteration(measured)
                if measured:  # no op computes in comms mode: all but collectives is overhead
                    compute_s = 0.0 if self.cfg.mode == "comms" else elapsed - comm_s
                    report.add_iteration(elapsed, compute_s, comm_s)
                else:
                    self._reset_timings()
                if self.progress is not None:
                    self.progress(it + 1, num_iters)
                if measured and stop.done(elapsed):  # the same iteration on every rank
                    break
        except OutOfMemory as e:
            report.set_oom(self.last_op, e.held_bytes, e.requested_bytes, e.message,
                           in_hook=self.stopped_in_hook)
        except Exception as e:  # a collective that failed or timed out, a strict mismatch
            report.set_failed(self.last_op, e)
        finally:
            if window:  # stopped inside a timed iteration: its peak up to there counts
                meter.stop()
        return report.finish(self)

    def close(self) -> None:
        """Stop measuring (the CPU meter gives torch its allocator back); the report stays."""
        self._close_meter()
