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

The first iteration itself repeats: a transformer's layers call the same kernels on inputs of
the same metadata (80 times on llama3_70b). A meta kernel's outputs follow from the callable,
its inputs' metadata and its other arguments' values, so the probe keeps each recipe under that
*signature* and a later call with the same signature is rebuilt from it without the kernel
(its outputs are still checked against the trace by the loop). A call whose arguments include
anything but tensors, numbers, strings, None, dtypes, devices, layouts, memory formats and
lists of those runs its kernel, as does every call whose signature has no recipe.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # a type only: step_plan builds on ops/, so a run-time import is a loop
    from actors.replay.step_plan import Step

# argument types a signature keys by value (type included: 1, 1.0 and True are equal in Python
# but give full() different dtypes)
_KEYED = frozenset((int, bool, str, type(None), torch.dtype, torch.device, torch.layout,
                    torch.memory_format))

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


def _value_key(a, inputs: list):
    """``a`` (a non-tensor argument, or a tensor by its position in ``inputs``) as part of a
    signature; raises KeyError for a value a signature cannot stand for."""
    t = type(a)
    if t in _KEYED:
        return t, a
    if t is float:
        return t, a.hex()  # tells -0.0 from 0.0
    if isinstance(a, torch.Tensor):
        return "T", next(i for i, x in enumerate(inputs) if x is a)
    if t is list or t is tuple:
        return t, tuple(_value_key(x, inputs) for x in a)
    raise KeyError(t)


def _signature(kernel, args: tuple, kwargs, inputs: list, before: list[tuple]):
    """What a meta kernel's outputs follow from: the callable, every argument's value (tensors
    by their metadata, storages by which inputs share one), None when an argument has no key."""
    try:
        values = tuple(_value_key(a, inputs) for a in args)
        named = tuple((k, _value_key(v, inputs)) for k, v in kwargs.items()) if kwargs else ()
    except KeyError:
        return None
    storages = [b[4] for b in before]
    tensors = tuple((type(t), b[:4], b[5], storages.index(b[4]), t.requires_grad, t.is_conj(),
                     t.is_neg(), t.layout, t.device) for t, b in zip(inputs, before))
    return kernel, values, named, tensors


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
        # signature -> recipe, from the probed calls of this iteration (see the module doc)
        self._known: dict[tuple, object] = {}
        self.num_reused = 0  # probed calls rebuilt from a known signature's recipe
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
        recipes, known = self._recipes, self._known

        def probed(*args, **kwargs):
            inputs = _tensors_in(args, kwargs)
            try:
                before = [_metadata(t) for t in inputs]
            except RuntimeError:  # a tensor without a storage (sparse): keep the kernel
                before = None
            key = None if before is None else _signature(kernel, args, kwargs, inputs, before)
            recipe = known.get(key) if key is not None else None
            if recipe is not None:  # the kernel gave these outputs for this signature before
                recipes[id(step)] = recipe
                self.num_reused += 1
                return _build(recipe, args)
            out = kernel(*args, **kwargs)  # its errors are the op's (the loop handles them)
            recipe = None if before is None else _checked_recipe(out, args, inputs, before)
            recipes[id(step)] = recipe
            if recipe is not None and key is not None:
                known[key] = recipe
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
        self._known.clear()
