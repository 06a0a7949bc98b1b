"""Calling one op off the loop's fast path: arguments from the registry (tensor lists,
tensors passed by keyword, index guards), outputs registered, the first iteration's check
of output shapes and dtypes against the trace, and what happens when an op raises."""
from __future__ import annotations

from typing import Callable

import torch

from actors.errors import ReplayError
from actors.replay.out_of_memory import OutOfMemory, is_allocation_failure
from actors.replay.ops import standins
from actors.trace.model import TensorArg

# What a replayed op may raise on synthetic data; the op is then skipped with its reason
# (unless it is the device refusing memory: that is an OOM).
OP_ERRORS = (RuntimeError, TypeError, ValueError, IndexError, NotImplementedError)


class OpCaller:
    """Calls steps with arguments from ``store`` and registers what they return.
    ``replanned`` is called when a step changes (a stand-in, a failure): the loop's
    sequences, which hold its fast tuple, must be rebuilt."""

    def __init__(self, store, owned: set[int], strict: bool, rank: int, memory=None,
                 meta: bool = False, replanned: Callable[[], None] = lambda: None):
        self.store = store
        self.owned = owned  # extensions' storages: their shapes are the extension's (ZeRO-3 shards)
        self.strict = strict
        self.rank = rank
        self.memory = memory  # a MemoryTracker: its figures go into an OOM
        self.meta = meta  # on meta, an op that needs values gets a stand-in
        self.replanned = replanned
        self.num_shape_mismatches = 0

    def run(self, step, check: bool) -> None:
        """An op off the fast path (tensor lists, keyword tensors, index guards, several
        outputs): call it, register its outputs."""
        try:
            out = self.call(step)
        except OP_ERRORS as e:
            out = self.failed(step, e)
        if out is not None:
            self.register(step.op, out, check)

    def failed(self, step, e: Exception):
        """An op raised. An input a flush dropped (the fast path passes it as None, which a
        required argument refuses) is re-materialized and the op retried; the device refusing
        memory is an OOM; on meta, an op that needs values returns its recorded outputs from
        now on (a stand-in); anything else skips the op from now on, with its reason counted.
        Returns the op's outputs when the retry or the stand-in ran."""
        tensors = self.store.tensors
        if step.fast is not None and any(tensors[t.uid] is None for _, t in step.tensor_slots):
            try:
                return self.call(step)
            except OP_ERRORS as again:
                e = again
        if is_allocation_failure(e):
            raise OutOfMemory(self.memory.held_bytes, 0, self.memory.capacity_bytes,
                              f"{type(e).__name__}: {str(e).splitlines()[0][:300]}") from None
        standin = standins.fallback(step, e) if self.meta else None
        if standin is not None:  # needs values meta tensors do not have: the trace's outputs
            step.fn, step.fast = standin, None
            step.standin = f"needs values on meta: {str(e).splitlines()[0][:120]}"
            self.replanned()
            return self.call(step)
        step.kind = "failed"
        step.fast = None
        step.reason = f"error: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
        self.replanned()  # rebuilt without its fast tuple before the next iteration
        return None

    def call(self, step):
        """Call ``step`` with every argument from the registry (materializing what is missing)."""
        store = self.store
        args = store.gather(step.template, step.tensor_slots, store.tensors)
        get = store.get
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
        return step.fn(*args, **kwargs) if kwargs is not None else step.fn(*args)

    def register(self, op, out, check: bool) -> None:
        """Register what ``op`` returned as its recorded outputs (checking them if asked)."""
        outputs = op.outputs
        results = (out,) if not isinstance(out, (tuple, list)) or \
            (len(outputs) == 1 and type(outputs[0]) is not TensorArg
             and outputs[0].kind == "tensor_list") else out
        register = self.store.register
        for expected, got in zip(outputs, results):
            if type(expected) is TensorArg:
                if isinstance(got, torch.Tensor):
                    if check and expected.suid not in self.owned and (
                            got.shape != expected.shape or str(got.dtype)[6:] != expected.dtype):
                        self._mismatch(op, expected, got)
                    register(expected, got)
            elif expected.kind == "tensor_list" and isinstance(got, (list, tuple)):
                for e, g in zip(expected.value, got):
                    if e is not None and isinstance(g, torch.Tensor):
                        register(e, g)

    def check_single(self, step, out) -> None:
        """The first iteration's check of a fast op's one output."""
        single = step.single_out
        if not isinstance(out, torch.Tensor):
            raise ReplayError(f"rank {self.rank}, node {step.op.node_id} {step.op.name}: "
                              f"returned {type(out).__name__}, the trace records one tensor")
        if single.suid not in self.owned and (out.shape != single.shape
                                              or out.dtype is not step.out_dtype):
            self._mismatch(step.op, single, out)

    def _mismatch(self, op, expected, got) -> None:
        self.num_shape_mismatches += 1
        if self.strict:
            raise ReplayError(f"rank {self.rank}, node {op.node_id} {op.name}: output "
                              f"{tuple(got.shape)} {got.dtype} != trace {expected.shape} "
                              f"{expected.dtype}")
