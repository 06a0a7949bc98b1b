"""Replay one rank's collectives with ``torch.distributed``, timed per kind.

Buffers: in ``full`` mode the engine passes ``get_tensor`` and every buffer is the compute
registry's tensor (collective outputs land where later ops read them). In ``comms`` mode
buffers are carved from two zero-filled byte arenas (send side, receive side) grown to the
largest message, so a replay allocates only when a bigger message shows up.

Semantics kept from the trace: sizes, dtype, uneven all_to_all splits, root/peer (a group
rank, as c10d records it), group, and which calls run async and where they complete
(async_plan.py); every call completes at ``wait_all`` at the latest. Reductions use SUM for floating dtypes and MAX
for integer/bool ones so index tensors stay in range. gloo (torch 2.13) natively supports
every kind here, reduce_scatter included (internally built on all_reduce); the one gap,
all_to_all with unequal list entries, is run as an all_to_all_single over packed buffers.

A hung peer is bounded by the process-group timeout (``ProcessGroups.create``, and the
default group's own): gloo raises, NCCL's watchdog aborts. Nothing here waits unbounded.
"""
from __future__ import annotations

import time
from functools import partial
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from actors.errors import CollectiveTimeout, ReplayError
from actors.replay.comm.calls import (CALLS, COALESCED_PART, Ctx, all_to_all_list,
                                            all_to_all_rows)
from actors.replay.comm.async_plan import plan_async
from actors.replay.comm.bandwidth import (CommStats, buffer_sizes, check_group_fit, element_splits,
                                        message_bytes)
from actors.replay.comm.process_groups import ProcessGroups
from actors.replay.ops.resolve import torch_dtype_or_none
from actors.trace.model import Arg, Op, TensorArg

# c10d ops whose first argument is the output (list) and second the input (list).
_OUT_FIRST = frozenset({
    "c10d::allgather_", "c10d::_allgather_base_", "c10d::allgather_coalesced_",
    "c10d::allgather_into_tensor_coalesced_", "c10d::_reduce_scatter_base_",
    "c10d::reduce_scatter_", "c10d::reduce_scatter_tensor_coalesced_", "c10d::alltoall_base_",
    "c10d::alltoall_", "c10d::gather_", "c10d::scatter_"})
_IN_PLACE = frozenset({"all_reduce", "all_reduce_coalesced", "broadcast", "reduce", "send",
                       "recv"})


def _flat(arg) -> list[TensorArg]:
    if type(arg) is TensorArg:
        return [arg]
    if type(arg) is Arg and arg.kind == "tensor_list":
        return [t for t in arg.value if t is not None]
    return []


def _arg_buffers(op: Op) -> tuple[list[TensorArg], list[TensorArg]]:
    """(send-side, receive-side) TensorArgs of a collective op, by its trace shape."""
    if op.name in _OUT_FIRST and len(op.inputs) >= 2:
        return _flat(op.inputs[1]), _flat(op.inputs[0])
    if op.name.startswith("c10d::"):  # in place: the one tensor (list) is both sides
        bufs = _flat(op.inputs[0]) if op.inputs else []
        return bufs, bufs
    ins = _flat(op.inputs[0]) if op.inputs else []  # functional ops, bare record_param_comms
    return ins, [t for a in op.outputs for t in _flat(a)]


class CollectiveReplayer:
    """Replays collective ops on ``groups``; per-kind stats in ``self.stats`` (CommStats)."""

    def __init__(self, groups: ProcessGroups, device: torch.device,
                 dtype_from_name: Callable[[str], torch.dtype | None] = torch_dtype_or_none,
                 ops: Sequence[Op] = (), cuda_sync_timing: bool = False):
        self.groups = groups
        self.device = torch.device(device)
        self.dtype_from_name = dtype_from_name
        self.stats = CommStats()
        self._sync = self.device.type == "cuda" and cuda_sync_timing
        self._waited: dict[int, int] = {}  # wait op index -> index of the call it completes
        self._async: set[int] = set()  # call op indices that run async_op=True
        self._complete_before: dict[int, list[int]] = {}  # op index -> unpaired calls due
        # seconds the caller spent in run / complete / wait_all: issuing and waiting for calls
        self.blocked_s = 0.0
        # issued, not completed, in issue order: call index -> (work, t0, kind, bytes, n, finish)
        self._pending: dict[int, tuple] = {}
        self._arenas: dict[str, torch.Tensor] = {}
        self.plan(ops)

    # --- planning -----------------------------------------------------------------------
    def plan(self, ops: Sequence[Op]) -> None:
        """Which calls run ``async_op=True`` and where each completes (async_plan).
        Without a plan every call is synchronous."""
        p = plan_async(ops)
        self._waited, self._async, self._complete_before = p.waited, p.calls, p.complete_before

    def hooks(self) -> dict[int, list]:
        """op index -> callables completing the async calls due right before that op."""
        return {i: [partial(self.complete, call) for call in calls]
                for i, calls in self._complete_before.items()}

    def complete(self, call: int) -> None:
        """Complete call ``call`` (an op index) if it is still in flight."""
        if call in self._pending:
            t0 = time.perf_counter()
            self._complete(call)
            self.blocked_s += time.perf_counter() - t0

    # --- running ------------------------------------------------------------------------
    def run(self, op: Op, get_tensor: Callable[[TensorArg], torch.Tensor] | None = None) -> None:
        """Replay one collective op (``get_tensor`` in full mode, None in comms mode)."""
        t0 = time.perf_counter()
        try:
            self._run(op, get_tensor)
        except RuntimeError as e:  # torch's errors; a ReplayError is not one
            self._raise_if_timed_out(e, t0, op)
            raise
        finally:
            self.blocked_s += time.perf_counter() - t0

    def _run(self, op: Op, get_tensor) -> None:
        c = op.collective
        if c is None:
            raise ReplayError(f"node {op.node_id} ({op.name}) is not a collective")
        if c.kind == "wait":
            call = self._waited.get(op.index)
            if call in self._pending:
                self._complete(call)
            return
        name = self.groups.name_of(c)
        pg = self.groups.resolve(c, op)
        n = len(self.groups.members(name))
        if c.group_size and c.group_size != n:
            raise self._error(op, f"trace recorded group size {c.group_size}, replay group "
                                  f"{name!r} has {n} ranks (world size must equal the trace's)")
        tensors = op.input_tensors() + op.output_tensors()
        dtype_name = c.dtype or next((t.dtype for t in tensors), None)
        dtype = self.dtype_from_name(dtype_name) if dtype_name else None
        if c.kind == "barrier":
            ins, outs = [], []
        elif get_tensor is not None:
            ins, outs = self._bind(op, get_tensor)
        else:
            if dtype is None:
                raise self._error(op, f"unknown dtype {dtype_name!r}")
            ins, outs = self._allocate(op, n, dtype)
        self._check(op, n, ins, outs)
        async_op = op.index in self._async
        t0 = self._now()
        work, finish = self._issue(op, name, pg, ins, outs, async_op)
        bufs = outs or ins
        itemsize = bufs[0].element_size() if bufs else (dtype.itemsize if dtype else 0)
        num_bytes = message_bytes(c.kind, c.in_nelems, c.out_nelems, itemsize, n)
        if async_op and work is not None:
            self._pending[op.index] = (work, t0, c.kind, num_bytes, n, finish)
            return
        if finish is not None:
            finish()
        self.stats.add(c.kind, num_bytes, self._now() - t0, n)

    def wait_all(self) -> None:
        """Complete every outstanding async call, in issue order."""
        t0 = time.perf_counter()
        for call in list(self._pending):
            self._complete(call)
        self.blocked_s += time.perf_counter() - t0

    def stats_dict(self) -> dict[str, dict]:
        """Per-kind stats for the rank report (``CommStats.to_dict``)."""
        return self.stats.to_dict()

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def _complete(self, call: int) -> None:
        work, t0, kind, num_bytes, n, finish = self._pending.pop(call)
        try:
            work.wait()
        except RuntimeError as e:
            self._raise_if_timed_out(e, t0, None, kind)
            raise
        if finish is not None:
            finish()
        self.stats.add(kind, num_bytes, self._now() - t0, n)

    def _now(self) -> float:
        if self._sync:  # the call only enqueued work on the GPU: time its completion
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _raise_if_timed_out(self, error: RuntimeError, started: float, op: Op | None,
                            kind: str | None = None) -> None:
        """Raise CollectiveTimeout for ``error`` when it came once the groups' timeout had
        passed since the call started: torch says a timeout in its message only."""
        timeout_s = self.groups.timeout_s
        if timeout_s is None or time.perf_counter() - started < timeout_s:
            return
        what = f"node {op.node_id} ({op.name}, {op.collective.kind})" if op is not None \
            else f"an async {kind}"
        first = (str(error).strip().splitlines() or ["(no message)"])[0]
        raise CollectiveTimeout(f"{what}: not complete within the process group timeout of "
                                f"{timeout_s:g} s: {first}") from error

    @staticmethod
    def _error(op: Op, message: str) -> ReplayError:
        return ReplayError(f"node {op.node_id} ({op.name}, {op.collective.kind}): {message}")

    # --- buffers ------------------------------------------------------------------------
    def _bind(self, op: Op, get_tensor) -> tuple[list, list]:
        """Full mode: the registry's tensors; functional outputs start as copies of inputs."""
        in_args, out_args = _arg_buffers(op)
        ins = [get_tensor(t) for t in in_args]
        outs = ins if out_args is in_args else [get_tensor(t) for t in out_args]
        if op.collective.kind in _IN_PLACE and outs is not ins and outs:
            for src, dst in zip(ins, outs):
                if dst.data_ptr() != src.data_ptr():
                    dst.copy_(src)
            ins = outs
        return ins, outs

    def _allocate(self, op: Op, n: int, dtype: torch.dtype) -> tuple[list, list]:
        """Comms mode: views of the arenas sized from the Collective record."""
        c = op.collective
        parts = [c.in_nelems]
        if c.kind.endswith("_coalesced"):  # part sizes from the args when they add up
            arg_parts = [t.numel for t in _arg_buffers(op)[0]]
            if arg_parts and sum(arg_parts) == c.in_nelems:
                parts = arg_parts
        try:
            in_sizes, out_sizes = buffer_sizes(c, n, parts, self._is_root(op))
        except ValueError as e:
            raise self._error(op, str(e)) from None
        if in_sizes is out_sizes:  # in place: one buffer list
            bufs = self._carve("in", dtype, in_sizes)
            return bufs, bufs
        return self._carve("in", dtype, in_sizes), self._carve("out", dtype, out_sizes)

    def _carve(self, side: str, dtype: torch.dtype, sizes: list[int]) -> list[torch.Tensor]:
        num_bytes = sum(sizes) * dtype.itemsize
        arena = self._arenas.get(side)
        if arena is None or arena.numel() < num_bytes:
            arena = torch.zeros(num_bytes, dtype=torch.uint8, device=self.device)
            self._arenas[side] = arena
        return list(arena[:num_bytes].view(dtype).split(sizes)) if sizes else []

    def _all_to_all_single(self, op: Op, n: int, pg, in_t, out_t, async_op: bool):
        c = op.collective
        if not c.in_splits and not c.out_splits:
            return dist.all_to_all_single(out_t, in_t, group=pg, async_op=async_op)
        if all_to_all_rows(c, in_t, out_t):
            return dist.all_to_all_single(out_t, in_t, list(c.out_splits), list(c.in_splits),
                                          group=pg, async_op=async_op)
        in_split, out_split = element_splits(c, n)  # flat buffers, splits in elements
        if sum(in_split) != in_t.numel() or sum(out_split) != out_t.numel():
            raise self._error(op, f"splits {list(c.in_splits)}/{list(c.out_splits)} do not fit "
                                  f"tensors of {in_t.numel()}/{out_t.numel()} elements")
        return dist.all_to_all_single(out_t.view(-1), in_t.view(-1), out_split, in_split,
                                      group=pg, async_op=async_op)

    # --- checks and calls ---------------------------------------------------------------
    def _is_root(self, op: Op) -> bool:
        name = self.groups.name_of(op.collective)
        return self.groups.global_rank(name, op.collective.root or 0) == self.groups.rank

    def _check(self, op: Op, n: int, ins: list, outs: list) -> None:
        """Counts that contradict the group size mean the trace is not for this world."""
        c = op.collective
        try:
            check_group_fit(c, n)
        except ValueError as e:
            raise self._error(op, str(e)) from None
        if c.kind.endswith("_coalesced"):
            want = (max(len(outs), 1),) * 2
        else:
            root = self._is_root(op)
            want = {"all_gather": (1, n), "reduce_scatter": (n, 1), "all_to_all": (n, n),
                    "gather": (1, n if root else 0), "scatter": (n if root else 0, 1),
                    "barrier": (0, 0)}.get(c.kind, (1, 1))
        if (len(ins), len(outs)) != want:
            raise self._error(op, f"expected {want[0]} input and {want[1]} output buffer(s) on "
                                  f"a {n}-rank group, the trace gives {len(ins)} and {len(outs)}")

    def _issue(self, op: Op, name: str, pg, ins: list, outs: list, async_op: bool):
        """Start the call; returns (work or None, finish callback or None)."""
        c = op.collective
        bufs = outs or ins
        floating = not bufs or bufs[0].dtype.is_floating_point or bufs[0].dtype.is_complex
        red = dist.ReduceOp.SUM if floating else dist.ReduceOp.MAX
        root = self.groups.global_rank(name, c.root or 0)
        if c.kind.endswith("_coalesced"):
            one = COALESCED_PART[c.kind]
            with dist._coalescing_manager(group=pg, async_ops=async_op) as cm:
                for i, t in enumerate(outs):
                    one(t, ins[i], red, pg)
            return cm, None
        if c.kind == "all_to_all":
            return all_to_all_list(outs, ins, pg, async_op)
        if c.kind == "all_to_all_single":
            n = len(self.groups.members(name))
            return self._all_to_all_single(op, n, pg, ins[0], outs[0], async_op), None
        call = CALLS.get(c.kind)
        if call is None:
            raise self._error(op, "collective kind not replayable")
        ctx = Ctx(pg, red, root, root == self.groups.rank, self.device)
        return call(ctx, ins, outs, async_op), None
