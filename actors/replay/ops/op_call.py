"""Calling one op off the loop's fast path: arguments from the registry (tensor lists,
tensors passed by keyword, index guards), outputs registered, and the first iteration's check
of output shapes and dtypes against the trace."""
from __future__ import annotations

import torch

from actors.errors import ReplayError
from actors.trace.model import TensorArg


class OpCaller:
    """Calls steps with arguments from ``store`` and registers what they return."""

    def __init__(self, store, owned: set[int], strict: bool, rank: int):
        self.store = store
        self.owned = owned  # extensions' storages: their shapes are the extension's (ZeRO-3 shards)
        self.strict = strict
        self.rank = rank
        self.num_shape_mismatches = 0

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
