"""The op loop of one rank: iterations, memory (policy, guard, flush, OOM), timing, report.

The engine runs one compiled program (actors/replay/program.py) with one list of extensions
(actors/replay/extension_list.py builds it; actors/replay/extension_contract.py is their
contract). The loop runs a precomputed sequence (actors/replay/iteration_sequence.py): compiled ops,
extension hooks (ZeRO-3 fetch/release, host gaps, async collectives' completion), the ops an
extension replays itself (collectives) and the allocation policy's frees after each op. It
never branches on the allocation mode or on which extensions are present: they are planned
into the sequence once.
"""
from __future__ import annotations

import time
import weakref
from itertools import islice

import torch

from actors.gc_pause import gc_paused
from actors.replay.config import ReplayConfig
from actors.replay.extension_list import build_extensions
from actors.replay.out_of_memory import OutOfMemory
from actors.replay.ops.op_call import OP_ERRORS
from actors.replay.program import compile_program, pick_device
from actors.replay.report import RankReport
from actors.replay.timed_iterations import StopRule
from actors.trace.model import Trace

__all__ = ["ReplayEngine", "pick_device"]


class _Flushed(Exception):
    """A flush dropped storages the fast sequence assumes held: continue at ``position`` in
    the checked sequence."""

    def __init__(self, position: int):
        super().__init__(position)
        self.position = position


class ReplayEngine:
    """Replays one rank's trace. Collectives go to ``comm`` (a CollectiveReplayer) when given;
    ``target`` adds the reserved-memory model, ``extensions`` the caller's own (the ZeRO-3
    emulation's, from the layer above; build_extensions); all of them join the loop at the
    points they plan."""

    def __init__(self, trace: Trace, cfg: ReplayConfig, device: torch.device | None = None,
                 comm=None, rank: int = 0, progress=None, extensions=(), *,
                 target=None):
        with gc_paused():  # a step per op and the plan's tables: no cycles (gc_pause.py)
            cfg.validate()
            device = device or pick_device(cfg.device)
            exts = build_extensions(trace, cfg, device, comm, extensions, target)
            program = compile_program(trace, cfg, device, rank, comm, exts)
        self.program = program
        ctx = program.ctx
        # the context's facilities under the same names: an engine can stand in for it
        self.trace, self.cfg, self.device, self.rank = trace, cfg, device, rank
        self.liveness, self.memory, self.store = ctx.liveness, ctx.memory, ctx.store
        self.comm, self.policy, self.extensions = comm, ctx.policy, ctx.extensions
        self.steps, self.calls, self.recorded = program.steps, program.calls, program.recorded
        self.room = program.room  # flushes (num_flushes, flushed_bytes) and OOMs
        self.sequences = program.sequences
        self.progress = progress  # callable(iteration, num_iterations) or None
        # extensions close at close() or when the engine is collected (the CPU meter wraps
        # torch's allocator)
        self._close = weakref.finalize(self, _close_all, tuple(self.extensions))
        self.last_op = None
        self.num_iterations_run = 0  # completed iterations, warm-up included
        self.stop_index: int | None = None  # op index the replay stopped at (OOM, failure)
        self.stopped_in_hook = False  # ... in an extension's hook next to that op
        self.stop_rule: StopRule | None = None  # when timing stops (set by run())
        self._extensions_allocated = False  # ReplayExtension.allocate ran (in _prepare)

    # --- the sequence ---------------------------------------------------------------------
    def sequence(self, sampled: bool, checked: bool) -> list[tuple]:
        """The entries of an iteration (iteration_sequence.build), built once per variant."""
        return self.sequences.get(sampled, checked)

    # --- iterations ---------------------------------------------------------------------
    def _iteration(self) -> float:
        """Run the sequence once; returns the seconds spent issuing and waiting for collectives.

        Output shapes and dtypes are checked in the first iteration only: they follow from
        the input shapes, which do not change, so later checks would only cost time. After a
        flush the rest of the iteration runs the checked sequence (iteration_sequence.py).
        """
        blocked_s = self._blocked_s()
        for ext in self.extensions:
            ext.on_iteration_start()
        position, checked = 0, False
        while True:
            try:
                self._run(self.sequences.get(self.memory.recording, checked), position,
                          checked)
                break
            except _Flushed as flushed:
                position, checked = flushed.position, True
        for ext in self.extensions:
            ext.settle()
        return self._blocked_s() - blocked_s

    def _blocked_s(self) -> float:
        """Seconds the extensions have spent in communication so far (collectives)."""
        return sum((ext.blocked_s() for ext in self.extensions), 0.0)

    def _run(self, entries: list[tuple], start: int, checked: bool) -> None:
        """Run ``entries`` from ``start``; raises _Flushed when a flush happens while the
        fast (unchecked) entries run. The loop keeps the common case (a fast-path op) inline,
        free of attribute lookups; every other entry is ``_run_step``'s."""
        memory, calls = self.memory, self.calls
        tensors, drop, add_new = self.store.tensors, self.store.drop, memory.add_new
        make_room, run_step = self.room.make_room, self._run_step
        check = self.num_iterations_run == 0
        timing = self.cfg.per_op_timing
        clock = time.perf_counter_ns
        step = None
        last = clock()
        try:
            for position, entry in enumerate(islice(entries, start, None), start):
                fn, getter, kwargs, out_uid, out_suid, out_bytes, limit, frees, step = entry
                memory.step = step
                if fn is not None:  # a fast-path op (step_plan.set_fast_path)
                    if memory.held_bytes > limit and make_room(step) and not checked:
                        raise _Flushed(position)
                    try:
                        out = fn(*getter(tensors), **kwargs) if kwargs is not None \
                            else fn(*getter(tensors))
                    except OP_ERRORS as e:
                        self._op_failed(step, e, check)
                    else:
                        tensors[out_uid] = out
                        if out_bytes:  # a fresh storage
                            add_new(out_suid, out_bytes)
                        if check:
                            calls.check_single(step, out)
                    out = None  # a storage freed below must not live on in a local
                else:
                    run_step(step, position, checked, check)
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
            self._note_stop(step)
            raise
        finally:
            if step is not None and step.op is not None:
                self.last_op = step.op

    def _run_step(self, step, position: int, checked: bool, check: bool) -> None:
        """An entry off the fast path: an extension's hook, a compute op the loop calls
        through ``calls``, or an op an extension replays (a collective), after making room
        for what it touches (_Flushed when that flushed while the fast entries run)."""
        kind = step.kind
        if kind == "hook":
            step.fn()
        elif kind in ("compute", "collective"):
            if self.memory.held_bytes + step.touch_bytes > self.room.guard and \
                    self.room.make_room(step) and not checked:
                raise _Flushed(position)
            if kind == "compute":
                self.calls.run(step, check)
            else:  # the extension replaying it (ReplayExtension.runs)
                step.fn()

    def _op_failed(self, step, error: BaseException, check: bool) -> None:
        """A fast-path op raised: ``calls.failed`` decides (a strict replay re-raises, else
        the op's outputs may still be made from the trace's shapes and registered)."""
        out = self.calls.failed(step, error)
        if out is not None:
            self.calls.register(step.op, out, check)

    def _note_stop(self, step) -> None:
        """Where the replay stopped (an OOM, a failure): the op, and whether it stopped in an
        extension's hook next to it."""
        if step is not None:
            op = step.op if step.op is not None else self.trace.ops[step.at]
            self.stop_index, self.last_op = op.index, op
            self.stopped_in_hook = step.op is None

    def _end_iteration(self, measured: bool) -> None:
        """Back to the persistent set; extensions release what they hold."""
        for ext in self.extensions:
            ext.on_iteration_end(measured)
        self.store.free_all()
        self.memory.recording = False
        if self.recorded is not None and self.num_iterations_run == 0:
            self.recorded.install()  # the kernels were probed: recipes from now on
            self.sequences.clear()
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
        exts = self.extensions
        shares = [s for s in (ext.world_share() for ext in exts) if s is not None]
        stop = StopRule(cfg.iters, cfg.min_time_s, cfg.ci_target, cfg.max_iters,
                        shares[0] if shares else None)
        self.stop_rule = stop
        num_iters = cfg.warmup_iters + stop.planned
        window = False
        try:
            self._prepare()
            for it in range(num_iters):
                measured = it >= cfg.warmup_iters
                if measured:
                    for ext in exts:
                        ext.start_measuring()
                    window = True
                t0 = time.perf_counter()
                comm_s = self._iteration()
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                elapsed = time.perf_counter() - t0
                if measured:
                    for ext in exts:
                        ext.stop_measuring()
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
                for ext in exts:
                    ext.stop_measuring()
        return report.finish(self)

    def close(self) -> None:
        """Close the extensions (the CPU meter gives torch its allocator back); the report
        stays."""
        self._close()


def _close_all(extensions: tuple) -> None:
    """Close every extension (``ReplayEngine.close``, or the engine was collected)."""
    for ext in extensions:
        ext.close()
