"""Known values on the fake device: small tensors a fake step computes from what it knows carry
their real values, so data-dependent branches take the path the real run takes.

A fake tensor has a shape and no data, so code that reads a value (``if mask.all():``,
``n = int(lengths.max())``, ``torch.nonzero(ids == pad)``) cannot run on it, and libraries
that know this branch on fakeness instead: transformers' ``is_tracing`` counts a FakeTensor as
tracing, skips its packed-sequence check and materializes a ``[B, 1, S, S]`` causal mask that
the real run never makes. Both come from one gap, and it closes for every library at once:

* Values where they are cheap and decide branches: integers and booleans. An op whose
  tensor inputs all have known values (or a factory with none: ``arange``, ``randint``,
  ``torch.tensor``), with integral or boolean outputs of at most ``max_numel`` elements, is
  also run for real on those values (inside the mode's own work, which is not recorded:
  actors/capture/fake/fake_mode.py). Token ids, position ids, attention and padding masks,
  lengths and counters get values; floating-point tensors (activations, parameters, anything
  computed from them) do not, so no model math runs for real. A write into a tensor with a
  value from one without forgets the value of its whole storage.
* Reading a known value works: ``item()``, ``bool()``, ``tolist()``, ``torch.equal``, and ops
  whose output shape depends on data (``nonzero``, ``masked_select``, ``unique``, ...).
* Fakeness is hidden where the value is known, from the libraries that ask: their "is this
  a fake tensor?" predicates (:data:`FAKE_PREDICATES`: transformers' ``is_fake_tensor``, which
  its ``is_tracing`` asks) answer no for a tensor with a known value, so the real branch runs
  exactly where it can. Tensors without a value still look fake, and code reading them still
  gets torch's data-dependent error. (torch's own class is left alone: torch.compile tells
  fake tensors by type, not by isinstance.)

Random factories draw real values from torch's generator (the real run's data differs, its
branch almost never does: "is any token padding" holds for every draw of random ids).
"""
from __future__ import annotations

import sys
from contextlib import contextmanager

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._mode_utils import no_dispatch

from actors.capture.readable import VALUE_ATTR, value_of

# 4 Mi elements: the ids and masks of a 32 x 128K batch; rotary tables of long sequences
DEFAULT_MAX_NUMEL = 1 << 22
_EMPTY = {torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default,
          torch.ops.aten.empty_like.default, torch.ops.aten.new_empty.default,
          torch.ops.aten.new_empty_strided.default}
# torch.tensor(data) under the mode: the data, a real tensor, is lifted into a fake one
_LIFTS = {torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default}
_READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default,
          torch.ops.aten.is_nonzero.default, torch.ops.aten.equal.default}
# outputs whose shape depends on the data: FakeTensorMode cannot make them without values
_DATA_SHAPED = {torch.ops.aten.nonzero.default, torch.ops.aten.masked_select.default,
                torch.ops.aten._unique2.default, torch.ops.aten.unique_dim.default,
                torch.ops.aten.unique_consecutive.default, torch.ops.aten.bincount.default,
                torch.ops.aten.repeat_interleave.Tensor, torch.ops.aten.argwhere.default}
_VALUE_NAMESPACES = ("aten", "prims")  # collectives and custom ops: no real run on values
UNANSWERED = object()


def _tensors(args, kwargs) -> list:
    """The tensor arguments, lists one level deep."""
    found = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            found.append(a)
        elif isinstance(a, (list, tuple)):
            found.extend(x for x in a if isinstance(x, torch.Tensor))
    return found


def _real(a):
    """An argument with fake tensors replaced by their values."""
    if isinstance(a, torch.Tensor):
        return value_of(a)
    if isinstance(a, (list, tuple)):
        return type(a)(_real(x) for x in a)
    return a


def _flat_outputs(out) -> list:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for x in out for t in _flat_outputs(x)]
    return []


class KnownValues:
    """The values a fake capture knows (see the module docstring); one per fake mode."""

    def __init__(self, max_numel: int = DEFAULT_MAX_NUMEL):
        self.max_numel = max_numel
        self._forgotten: set = set()  # fake storages written with unknown data
        self._written: dict = {}  # op -> indices of the arguments it writes

    def known(self, t) -> torch.Tensor | None:
        """``t``'s value unless its storage was overwritten with unknown data."""
        value = value_of(t)
        if value is None or not self._forgotten:
            return value
        return None if StorageWeakRef(t.untyped_storage()) in self._forgotten else value

    def before(self, mode, func, args, kwargs):
        """The answer of a value read or a data-shaped op when its inputs are known, else
        ``UNANSWERED`` (the fake mode answers)."""
        if func not in _READS and func not in _DATA_SHAPED:
            return UNANSWERED
        tensors = _tensors(args, kwargs)
        if not tensors or any(self.known(t) is None for t in tensors):
            return UNANSWERED
        real = self._compute(func, args, kwargs)
        if real is UNANSWERED or func in _READS:
            return real
        return _fake_like(mode, real)

    def after(self, func, args, kwargs, out) -> None:
        """Give ``out`` its values when every input's is known and it is small; forget the
        values of arguments an op wrote from unknown data."""
        tensors = _tensors(args, kwargs)
        if func in _LIFTS:
            self._lift(tensors, out)
            return
        valued = [t for t in tensors if value_of(t) is not None]
        if len(valued) != len(tensors) or getattr(func, "namespace", None) not in _VALUE_NAMESPACES:
            if valued:
                self._forget_written(func, args, kwargs)
            return
        outputs = _flat_outputs(out)
        if not outputs or any(o.numel() > self.max_numel or o.is_floating_point()
                              or o.is_complex() for o in outputs):
            if valued:
                self._forget_written(func, args, kwargs)
            return
        if any(self.known(t) is None for t in valued):
            self._forget_written(func, args, kwargs)
            return
        if func in _EMPTY:  # garbage in the real run: any value will be overwritten
            real = [torch.zeros(o.shape, dtype=o.dtype) for o in outputs]
        else:
            real = self._compute(func, args, kwargs)
            if real is UNANSWERED:
                self._forget_written(func, args, kwargs)
                return
            real = _flat_outputs(real)
        if len(real) != len(outputs):
            return
        for fake, value in zip(outputs, real):
            if value_of(fake) is not value and tuple(value.shape) == tuple(fake.shape):
                setattr(fake, VALUE_ATTR, value)

    def _lift(self, tensors: list, out) -> None:
        """``torch.tensor(data)``: a small integral or boolean constant's value is itself."""
        source = tensors[0] if len(tensors) == 1 else None
        if isinstance(out, FakeTensor) and isinstance(source, torch.Tensor) \
                and not isinstance(source, FakeTensor) and source.numel() <= self.max_numel \
                and not (source.is_floating_point() or source.is_complex()):
            setattr(out, VALUE_ATTR, source.detach().to("cpu", copy=True))

    def _compute(self, func, args, kwargs):
        """``func`` run for real on the values (``UNANSWERED`` when it cannot run on them)."""
        real_args = [_real(a) for a in args]
        real_kwargs = {k: _real(v) for k, v in kwargs.items()}
        if "device" in real_kwargs:
            real_kwargs["device"] = torch.device("cpu")
        try:
            with no_dispatch():
                return func(*real_args, **real_kwargs)
        except Exception:  # noqa: BLE001 - an op that cannot run on the values has none
            return UNANSWERED

    def _forget_written(self, func, args, kwargs) -> None:
        written = self._written.get(func)
        if written is None and not hasattr(func, "_schema"):
            return
        if written is None:
            written = self._written[func] = tuple(
                i for i, a in enumerate(func._schema.arguments)
                if a.alias_info is not None and a.alias_info.is_write)
        if not written:
            return
        names = [a.name for a in func._schema.arguments]
        for i in written:
            target = args[i] if i < len(args) else kwargs.get(names[i])
            for t in _flat_outputs(target):
                if value_of(t) is not None:
                    self._forgotten.add(StorageWeakRef(t.untyped_storage()))


def _fake_like(mode, real: torch.Tensor | tuple):
    """Fresh fake tensors shaped as ``real`` (a data-shaped op's real outputs), with their
    values."""
    if isinstance(real, (tuple, list)):
        return type(real)(_fake_like(mode, r) for r in real)
    with no_dispatch():
        meta = torch.empty_strided(real.shape, real.stride(), dtype=real.dtype, device="meta")
    fake = FakeTensor(mode, meta, real.device)
    setattr(fake, VALUE_ATTR, real)
    return fake


# Libraries' "is this tensor fake?" predicates: (module, function name). A predicate is
# wrapped only when its module is already imported (the user's code imported the library).
FAKE_PREDICATES = (("transformers.utils.import_utils", "is_fake_tensor"),)


@contextmanager
def known_values_look_real():
    """Within the block, the libraries' fakeness predicates (:data:`FAKE_PREDICATES`) answer
    no for tensors whose values are known."""
    restore = []
    for module_name, name in FAKE_PREDICATES:
        module = sys.modules.get(module_name)
        original = getattr(module, name, None) if module is not None else None
        if original is None:
            continue

        def predicate(x, _original=original):
            return _original(x) and value_of(x) is None

        setattr(module, name, predicate)
        restore.append((module, name, original))
    try:
        yield
    finally:
        for module, name, original in restore:
            setattr(module, name, original)
