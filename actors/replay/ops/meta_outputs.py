"""Meta dry runs without meta kernels after the first iteration: recorded outputs.

On ``meta`` an op computes nothing but its outputs' metadata, yet many meta kernels are
Python decompositions (elementwise ops go through torch._refs type promotion and broadcasting):
50-500 us per op, against about 2 us for ``torch.empty_strided``. Every iteration replays the
same ops on inputs of the same shapes, so the first iteration runs the real kernels (and checks
their outputs against the trace, op_call.py) while a probe watches each op; later iterations
call a *recipe* instead, which rebuilds exactly what the kernel returned:

* a fresh tensor (no input's storage, offset 0, minimal storage): ``empty_strided`` with the
  shape, strides and dtype the kernel gave;
* an input returned as is (an in-place op: ``add_`` returns ``self``): that input;
* a non-tensor value (an int, None): the same value.

An op keeps running its kernel when a recipe could differ from it: an output that is a view of
an input or shares its storage (views must stay views of their base), an input whose metadata
the op changed (``resize_``, ``transpose_``, ``set_``), a tensor subclass or a non-strided
layout, or an op that raised (stand-ins and failures keep their own handling, engine.py).
Accounting never reads tensors (it follows the trace's storages), so peaks, breakdowns and
flush decisions are the kernels' to the byte; a recipe still refuses an input a flush dropped
(None), as the kernel would, so the loop re-materializes it exactly as before.
"""
from __future__ import annotations

import torch

from actors.replay.steps import Step

_META = torch.device("meta")
_empty_strided = torch.empty_strided


def _tensors_in(args, kwargs) -> list[torch.Tensor]:
    """The tensors among an op's arguments (one level of lists: ``cat``'s Tensor[])."""
    found = []
    for a in (*args, *(kwargs or {}).values()):
        if isinstance(a, torch.Tensor):
            found.append(a)
        elif isinstance(a, (list, tuple)):
            found.extend(x for x in a if isinstance(x, torch.Tensor))
    return found


def _metadata(x: torch.Tensor) -> tuple:
    storage = x.untyped_storage()
    return (x.shape, x.stride(), x.storage_offset(), x.dtype, storage._cdata, storage.nbytes())


def _fresh_maker(x: torch.Tensor):
    """A callable rebuilding tensor ``x`` when ``x`` is a plain fresh meta tensor, else None."""
    if type(x) is not torch.Tensor or x.layout is not torch.strided or x.storage_offset() \
            or x.requires_grad or x.is_conj() or x.is_neg() or x.device.type != "meta":
        return None
    size, stride, dtype = tuple(x.shape), x.stride(), x.dtype
    if _empty_strided(size, stride, dtype=dtype, device=_META).untyped_storage().nbytes() != \
            x.untyped_storage().nbytes():
        return None  # the kernel made a larger storage than the view reaches: keep the kernel
    return lambda: _empty_strided(size, stride, dtype=dtype, device=_META)


def _recipe_of(out, args: tuple, inputs: list[torch.Tensor], storages: set[int]):
    """What rebuilds ``out`` from the call's arguments: ``(kind, value)`` with kind 'fresh'
    (value: a maker), 'arg' (value: the positional index returned), 'const' (value itself),
    'seq' (value: (type, recipes)); None when the kernel must keep running."""
    if isinstance(out, torch.Tensor):
        for i, a in enumerate(args):
            if a is out:
                return ("arg", i)
        if any(out is t for t in inputs) or out.untyped_storage()._cdata in storages:
            return None  # a view of an input, or a keyword/list input returned: keep the kernel
        maker = _fresh_maker(out)
        return None if maker is None else ("fresh", maker)
    if isinstance(out, (tuple, list)):
        parts = [_recipe_of(x, args, inputs, storages) for x in out]
        return None if any(p is None for p in parts) else ("seq", (type(out), parts))
    if out is None or type(out) in (int, float, bool):
        return ("const", out)
    return None


def _checked_recipe(out, args: tuple, inputs: list[torch.Tensor], before: list[tuple]):
    """The recipe of a probed call, None when the op changed an input's shape, strides or
    storage, or when an output cannot be inspected (a probe never fails the op)."""
    try:
        if any(_metadata(t) != b for t, b in zip(inputs, before)):
            return None
        return _recipe_of(out, args, inputs, {b[4] for b in before})
    except RuntimeError:  # e.g. an output without a storage
        return None


def _build(recipe, args):
    kind, value = recipe
    if kind == "fresh":
        return value()
    if kind == "arg":
        return args[value]
    if kind == "const":
        return value
    kind, parts = value
    return kind(_build(p, args) for p in parts)


def _replayer(recipe, tensor_positions: tuple[int, ...], name: str):
    """The op's stand-in callable: refuses a dropped input (None) like the kernel, then
    builds the recorded outputs."""
    if recipe[0] == "fresh":  # the common case, one closure call and one empty_strided
        make = recipe[1]

        def fresh(*args, **kwargs):
            for p in tensor_positions:
                if args[p] is None:
                    raise TypeError(f"{name}: tensor argument {p} is None (dropped by a flush)")
            return make()
        return fresh

    def rebuild(*args, **kwargs):
        for p in tensor_positions:
            if args[p] is None:
                raise TypeError(f"{name}: tensor argument {p} is None (dropped by a flush)")
        return _build(recipe, args)
    return rebuild


class RecordedOutputs:
    """Probes the compute steps' kernels in the first iteration (``probe``), then swaps each
    step whose outputs a recipe rebuilds exactly for that recipe (``install``)."""

    def __init__(self, steps: list[Step]):
        self.steps = [s for s in steps if s.kind == "compute" and not s.standin]
        self._recipes: dict[int, object] = {}  # id(step) -> recipe
        self._kernels: dict[int, tuple] = {}  # id(step) -> (the kernel, its probe)
        self.num_recorded = 0  # steps now returning recorded outputs (after install)

    def probe(self) -> None:
        """Wrap every compute step's kernel with a probe for the (first) iteration to come."""
        for step in self.steps:
            probe = self._probe(step, step.fn)
            self._kernels[id(step)] = (step.fn, probe)
            step.fn = probe
            if step.fast is not None:
                step.fast = (probe,) + step.fast[1:]

    def _probe(self, step: Step, kernel):
        recipes = self._recipes

        def probed(*args, **kwargs):
            inputs = _tensors_in(args, kwargs)
            try:
                before = [_metadata(t) for t in inputs]
            except RuntimeError:  # a tensor without a storage (sparse): keep the kernel
                before = None
            out = kernel(*args, **kwargs)  # its errors are the op's (the loop handles them)
            recipes[id(step)] = None if before is None else _checked_recipe(out, args, inputs,
                                                                            before)
            return out
        return probed

    def install(self) -> None:
        """After the probed iteration: recipes where the probe found one, the kernel back
        everywhere else (steps a stand-in or a failure took over keep theirs)."""
        for step in self.steps:
            kernel, probe = self._kernels.pop(id(step), (None, None))
            if step.fn is not probe or step.kind != "compute":
                continue  # a stand-in or a failure took the step over: theirs now
            recipe = self._recipes.get(id(step))
            if recipe is not None:
                positions = tuple(pos for pos, _ in step.tensor_slots)
                fn = _replayer(recipe, positions, step.op.name)
                self.num_recorded += 1
            else:
                fn = kernel
            step.fn = fn
            if step.fast is not None:
                step.fast = (fn,) + step.fast[1:]
        self._recipes.clear()
