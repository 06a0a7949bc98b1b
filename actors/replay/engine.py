"""The op loop of one rank: iterations, allocation policy, flushing, OOM, timing, report."""
from __future__ import annotations

import time
from collections import Counter

import torch

from actors.errors import ReplayError
from actors.replay import plan as planning
from actors.replay import resolve
from actors.replay.config import ReplayConfig, parse_bytes
from actors.replay.memory import MemoryTracker, OutOfMemory, device_capacity
from actors.replay.report import RankReport
from actors.replay.tensor_store import TensorStore
from actors.trace.liveness import compute_liveness
from actors.trace.model import Trace, TensorArg


# What a replayed op may raise on synthetic data; the op is then skipped with its reason.
_OP_ERRORS = (RuntimeError, TypeError, ValueError, IndexError, NotImplementedError)


def pick_device(name: str) -> torch.device:
    """auto -> cuda (the rank's GPU) when available, else cpu."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ReplayError("replay.device=cuda but this rank sees no CUDA device")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(name)


class ReplayEngine:
    """Replays one rank's trace. Collectives go to ``comm`` (a CollectiveReplayer) when given."""

    def __init__(self, trace: Trace, cfg: ReplayConfig, device: torch.device | None = None,
                 comm=None, rank: int = 0, progress=None):
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
        self.liveness = compute_liveness(trace.ops, trace.num_storages)
        self.steps = [planning.compile_step(op, self.device, cfg.mode) for op in trace.ops]
        self._set_new_bytes()
        capacity = parse_bytes(cfg.device_memory_capacity) if cfg.device_memory_capacity else None
        self.memory = MemoryTracker(device_capacity(self.device, capacity), cfg.timeline_max_points)
        ranges = planning.index_ranges(self.steps)
        planning.add_guards(self.steps, ranges, self.liveness.storage_external)
        planning.set_fast_path(self.steps)
        self.store = TensorStore(trace.num_tensors, self.liveness, self.memory, self.device,
                                 resolve.torch_dtype, ranges)
        self.lazy = cfg.allocation.mode == "lazy"
        threshold = cfg.allocation.device_memory_threshold
        if threshold < 1 and self.memory.capacity_bytes is None:
            raise ReplayError("replay.allocation.device_memory_threshold needs a device capacity: "
                              f"set replay.device_memory_capacity for device {self.device.type}")
        self.flush_bytes = threshold * self.memory.capacity_bytes if threshold < 1 else None
        self.op_time_ns = [0] * len(self.steps)
        self.num_shape_mismatches = 0
        self.num_flushes = 0
        self.flushed_bytes = 0
        self.last_op = None
        self.num_iterations_run = 0

    def _set_new_bytes(self):
        live = self.liveness
        for s, first in enumerate(live.storage_first):
            if first >= 0:
                self.steps[first].new_bytes += live.storage_bytes[s]

    # --- one op (slow paths; the fast path is inlined in _iteration) ----------------------
    def _fill_rare(self, step, args) -> dict | None:
        """Tensor lists, tensors passed by keyword and index guards; returns the kwargs."""
        get = self.store.get
        for pos, tensors in step.list_slots:
            args[pos] = [None if t is None else get(t) for t in tensors]
        kwargs = step.kwargs
        if step.kw_tensor_slots:
            kwargs = dict(kwargs or {})
            for name, t in step.kw_tensor_slots:
                kwargs[name] = get(t) if type(t) is TensorArg else \
                    [None if x is None else get(x) for x in t]
        for pos, lo, hi in step.guards:
            args[pos].clamp_(lo, hi)
        return kwargs

    def _register_outputs(self, op, out, check: bool) -> None:
        outputs = op.outputs
        results = (out,) if not isinstance(out, (tuple, list)) or \
            (len(outputs) == 1 and type(outputs[0]) is not TensorArg and outputs[0].kind == "tensor_list") \
            else out
        register = self.store.register
        for expected, got in zip(outputs, results):
            if type(expected) is TensorArg:
                if isinstance(got, torch.Tensor):
                    if check and (got.shape != expected.shape
                                  or str(got.dtype)[6:] != expected.dtype):
                        self._mismatch(op, expected, got)
                    register(expected, got)
            elif expected.kind == "tensor_list" and isinstance(got, (list, tuple)):
                for e, g in zip(expected.value, got):
                    if e is not None and isinstance(g, torch.Tensor):
                        register(e, g)

    def _mismatch(self, op, expected, got):
        self.num_shape_mismatches += 1
        if self.cfg.strict:
            raise ReplayError(f"rank {self.rank}, node {op.node_id} {op.name}: output "
                              f"{tuple(got.shape)} {got.dtype} != trace {expected.shape} {expected.dtype}")

    def _before(self, step) -> None:
        """Flush when held bytes cross the threshold; OOM when the op's new bytes do not fit."""
        memory = self.memory
        if self.flush_bytes is not None and memory.held_bytes > self.flush_bytes:
            self._flush()
        cap = memory.capacity_bytes
        if cap is not None and memory.held_bytes + step.new_bytes > cap:
            raise OutOfMemory(memory.held_bytes, step.new_bytes, cap)

    def _run_general(self, step, check: bool, guard: float) -> bool:
        """An op off the fast path (tensor lists, keyword tensors, index guards, several
        outputs); False when it raised and is skipped from now on."""
        if self.memory.held_bytes + step.new_bytes > guard:
            self._before(step)
        args = step.template.copy()
        get = self.store.get
        for pos, t in step.tensor_slots:
            args[pos] = get(t)
        kwargs = self._fill_rare(step, args)
        try:
            out = step.fn(*args, **kwargs) if kwargs is not None else step.fn(*args)
        except _OP_ERRORS as e:
            if isinstance(e, torch.OutOfMemoryError):
                raise
            self._fail(step, e)
            return False
        self._register_outputs(step.op, out, check)
        return True

    def _check_single(self, step, out) -> None:
        single = step.single_out
        if out.shape != single.shape or out.dtype is not step.out_dtype:
            self._mismatch(step.op, single, out)

    def _fail(self, step, e: Exception) -> None:
        """An op that raises is skipped from now on, with its reason counted."""
        step.kind = "failed"
        step.fast = None
        step.reason = f"error: {type(e).__name__}: {str(e).splitlines()[0][:160]}"

    # --- iterations ---------------------------------------------------------------------
    def _iteration(self) -> tuple[float, float]:
        """Run every step once; returns (compute seconds, collective seconds).

        Output shapes and dtypes are checked in the first iteration only: they follow from
        the input shapes, which do not change, so later checks would only cost time.
        """
        memory, steps, times = self.memory, self.steps, self.op_time_ns
        store = self.store
        tensors, materialize, held = store.tensors, store.materialize, memory.held
        free_after, lazy, comm = self.liveness.free_after, self.lazy, self.comm
        get = store.get if self.cfg.mode == "full" else None
        limits = [x for x in (self.flush_bytes, memory.capacity_bytes) if x is not None]
        guard = min(limits) if limits else float("inf")
        check = self.num_iterations_run == 0
        compute_ns = comm_ns = 0
        clock = time.perf_counter_ns
        Tensor = torch.Tensor
        tick, next_sample = memory.tick, memory.next_sample
        i = -1
        # One clock read per op: an op's time runs from the end of the previous one, so the
        # replay's own bookkeeping is charged to the op it serves.
        last = clock()
        try:
            for i, fast in enumerate([step.fast for step in steps]):
                if fast is not None:  # the common case, kept free of attribute lookups
                    fn, args, slots, kwargs, out_uid, out_suid, new_bytes = fast
                    if memory.held_bytes + new_bytes > guard:
                        self._before(steps[i])
                    args = args.copy()
                    for pos, uid, t in slots:
                        x = tensors[uid]
                        args[pos] = x if x is not None else materialize(t)
                    try:
                        out = fn(*args, **kwargs) if kwargs is not None else fn(*args)
                    except _OP_ERRORS as e:
                        if isinstance(e, torch.OutOfMemoryError):
                            raise
                        self._fail(steps[i], e)
                        continue
                    if type(out) is Tensor:
                        tensors[out_uid] = out
                        if out_suid not in held:  # MemoryTracker.add, inlined
                            nbytes = out.untyped_storage().nbytes()
                            held[out_suid] = nbytes
                            memory.held_bytes += nbytes
                            if memory.held_bytes > memory.peak_bytes:
                                memory.peak_bytes = memory.held_bytes
                        if check:
                            self._check_single(steps[i], out)
                    else:
                        self._register_outputs(steps[i].op, out, check)
                    now = clock()
                    dt = now - last
                    compute_ns += dt
                elif steps[i].kind == "compute":
                    if not self._run_general(steps[i], check, guard):
                        continue
                    now = clock()
                    dt = now - last
                    compute_ns += dt
                elif steps[i].kind == "collective":
                    step = steps[i]
                    if memory.held_bytes + step.new_bytes > guard:
                        self._before(step)
                    comm.run(step.op, get)
                    now = clock()
                    dt = now - last
                    comm_ns += dt
                else:
                    continue
                last = now
                times[i] += dt
                if lazy:
                    for s in free_after[i]:
                        store.free(s)
                tick += 1
                if tick == next_sample:
                    next_sample = memory.sample(tick)
        finally:
            memory.tick, memory.next_sample = tick, next_sample
            if 0 <= i < len(steps):
                self.last_op = steps[i].op
        if comm is not None:
            t0 = clock()
            comm.wait_all()
            comm_ns += clock() - t0
        self.num_iterations_run += 1
        return compute_ns / 1e9, comm_ns / 1e9

    def _flush(self):
        if self.comm is not None:
            self.comm.wait_all()
        self.flushed_bytes += self.store.free_all()
        self.num_flushes += 1

    def _prepare(self):
        """pre_allocate: every tensor no replayed op produces exists before the first iteration."""
        if self.lazy:
            return
        live = self.liveness
        for step in self.steps:
            if step.kind == "skip":
                continue
            for t in step.op.input_tensors():
                if live.storage_external[t.suid] and self.store.tensors[t.uid] is None:
                    self.store.materialize(t)
                    self.store.pin(t.suid)

    def run(self) -> RankReport:
        """Warm-up and measured iterations; OOM and failures become the report's status."""
        report = RankReport.start(self)
        num_iters = self.cfg.warmup_iters + self.cfg.iters
        try:
            self._prepare()
            for it in range(num_iters):
                t0 = time.perf_counter()
                compute_s, comm_s = self._iteration()
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                elapsed = time.perf_counter() - t0
                self.store.free_all()  # back to the pinned (persistent) set
                if it >= self.cfg.warmup_iters:
                    report.add_iteration(elapsed, compute_s, comm_s)
                else:
                    self.op_time_ns = [0] * len(self.steps)
                    if self.comm is not None:
                        self.comm.stats.reset()
                if self.progress is not None:
                    self.progress(it + 1, num_iters)
        except OutOfMemory as e:
            report.set_oom(self.last_op, e.held_bytes, e.requested_bytes)
        except torch.OutOfMemoryError as e:
            report.set_oom(self.last_op, self.memory.held_bytes, 0, str(e).splitlines()[0])
        return report.finish(self)

    def top_ops(self, n: int = 15) -> list[dict]:
        """Ops by total time over the measured iterations."""
        total, calls = Counter(), Counter()
        for step, ns in zip(self.steps, self.op_time_ns):
            if ns:
                total[step.op.name] += ns
                calls[step.op.name] += 1
        iters = max(1, self.cfg.iters)
        return [{"name": name, "num_calls": calls[name] * iters, "total_s": ns / 1e9,
                 "mean_us": ns / 1e3 / (calls[name] * iters)} for name, ns in total.most_common(n)]

    def coverage(self) -> tuple[int, int, Counter]:
        """(replayed, in scope, skip reasons) counted over the mode's scope."""
        reasons = Counter()
        in_scope = replayed = 0
        for i, step in enumerate(self.steps):
            if step.reason == "out of scope":
                continue
            in_scope += 1
            reason = step.reason if step.kind in ("skip", "failed") else None
            if reason:
                reasons[reason] += 1
            else:
                replayed += 1
        return replayed, in_scope, reasons

