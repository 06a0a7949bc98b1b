"""The replay's tensors: a registry by tensor uid over storages by storage generation (suid).

Tensors the replay has not produced (parameters, inputs, optimizer state, or anything freed
by a flush) are materialized as views over a storage sized from the trace's liveness, so
storage sharing, offsets, shapes and strides are preserved. Integer storages that feed index
ops are filled inside a safe range; everything else gets a cheap constant fill.

Every storage the store holds is accounted in the MemoryTracker with its trace size; tensors
an extension binds (``bind``) are accounted by the extension itself.
"""
from __future__ import annotations

import torch

from actors.replay.ops.index_safety import DEFAULT_INT_RANGE, fill_int_tensor
from actors.errors import ReplayError, describe
from actors.replay.memory.accounting import MemoryTracker
from actors.replay.out_of_memory import is_allocation_failure
from actors.trace.liveness import Liveness
from actors.trace.model import TensorArg

FLOAT_FILL = 0.0625  # exact in every float format; no NaN/denormal slow paths
MAX_STORAGE_BYTES = (1 << 63) - 1  # torch's sizes are int64


class TensorStore:
    """uid -> tensor, suid -> storage base, with memory accounting and freeing by suid.

    ``tensors`` is the registry the op loop reads: index ``uid`` holds tensor ``uid`` (None
    when not held); past ``num_tensors`` it holds constant arguments (``constant``), so one
    ``itemgetter`` fetches an op's whole argument tuple.
    """

    def __init__(self, num_tensors: int, liveness: Liveness, memory: MemoryTracker,
                 device: torch.device, dtype_of, int_ranges: dict[int, tuple[int, int, bool]]):
        self.tensors: list = [None] * num_tensors
        self._bases: dict[int, torch.Tensor] = {}  # suid -> flat tensor we allocated
        self.uids_by_suid = liveness.uids_by_suid
        self.storage_bytes = liveness.storage_bytes
        self.memory = memory
        self.device = device
        self._dtype_of = dtype_of  # dtype name -> torch.dtype
        self._int_ranges = int_ranges  # suid -> (lo, hi, monotonic) for data feeding index ops
        self.pinned: frozenset[int] = frozenset()  # the allocation policy's persistent set
        self.owned: frozenset[int] = frozenset()  # extensions' storages: they account them
        self.num_materialized = 0
        # drop(suid): every tensor on a storage generation goes, and its accounted bytes (the
        # policy's frees: never pinned ones); returns those bytes
        self.drop = _dropper(self.tensors, self.uids_by_suid, self._bases, memory.release)

    def get(self, t: TensorArg) -> torch.Tensor:
        """The registered tensor for ``t``, materializing it if the replay does not hold it."""
        x = self.tensors[t.uid]
        return x if x is not None else self.materialize(t)

    def constant(self, value) -> int:
        """Put a constant argument into the registry; returns its index."""
        self.tensors.append(value)
        return len(self.tensors) - 1

    def gather(self, template: list, slots: tuple, tensors: list) -> list:
        """An op's positional arguments: ``template`` with its tensor ``slots`` (position,
        TensorArg) filled from ``tensors`` (this store's registry), materializing what is
        missing."""
        args = template.copy()
        for pos, t in slots:
            x = tensors[t.uid]
            args[pos] = x if x is not None else self.materialize(t)
        return args

    def materialize(self, t: TensorArg) -> torch.Tensor:
        """A view for ``t`` over its storage, allocating the storage if it is not held.

        ReplayError when the trace's shape, strides and offset describe no tensor torch can
        make (sizes past 64 bits, a view outside its storage); the device refusing the memory
        stays an allocation failure (an OOM)."""
        try:
            size, stride = t.shape, t.stride
            if stride is None or len(stride) != len(size):  # not recorded (or unusable): contiguous
                stride = torch.empty(size, device="meta").stride()
            x = self._view_of_held(t, size, stride)
            if x is None:
                base = self._bases.get(t.suid)
                if base is None:
                    base = self._allocate(t)
                x = torch.as_strided(base, size, stride, t.offset)
        except (RuntimeError, TypeError, ValueError, OverflowError) as e:
            if is_allocation_failure(e):
                raise
            raise ReplayError(f"tensor {t.tensor_id} (storage {t.storage_id}, shape "
                              f"{str(t.shape)[:60]}, stride {str(t.stride)[:60]}, offset "
                              f"{t.offset}, {t.dtype}) cannot be made: {describe(e)[:200]}") from None
        self.register(t, x)
        self.num_materialized += 1
        return x

    def _view_of_held(self, t: TensorArg, size, stride) -> torch.Tensor | None:
        """A view for ``t`` on the storage an op produced (no base of ours: the op allocated
        it), so writes through it reach the same memory, as they did in the original; None
        when the storage is not held by an op's output or does not reach the view."""
        if t.suid in self._bases or not self.memory.held[t.suid]:
            return None
        tensors = self.tensors
        for uid in self.uids_by_suid[t.suid]:
            other = tensors[uid]
            if other is not None:
                try:  # storage_offset is absolute: any tensor of the storage is a base
                    return torch.as_strided(other, size, stride, t.offset)
                except RuntimeError:  # the op's storage is smaller than the trace's view
                    return None
        return None

    def _allocate(self, t: TensorArg) -> torch.Tensor:
        nbytes = max(self.storage_bytes[t.suid], t.extent_elems * t.itemsize)
        if nbytes > MAX_STORAGE_BYTES:
            raise ValueError(f"its storage would span {nbytes:,} bytes, past torch's 64-bit "
                             "sizes")
        self.memory.check(nbytes)
        dtype = self._dtype_of(t.dtype)
        base = torch.empty(-(-nbytes // t.itemsize), dtype=dtype, device=self.device)
        if self.device.type != "meta":
            if dtype.is_floating_point or dtype.is_complex:
                base.fill_(FLOAT_FILL)
            else:
                lo, hi, monotonic = self._int_ranges.get(t.suid, (*DEFAULT_INT_RANGE, False))
                fill_int_tensor(base, lo, hi, monotonic)
        self._bases[t.suid] = base
        return base

    def register(self, t: TensorArg, x: torch.Tensor) -> None:
        """Record ``x`` as tensor ``t`` (an op output or a materialized view)."""
        self.tensors[t.uid] = x
        if t.suid not in self.owned:  # an extension-owned storage is charged by its owner
            self.memory.add(t.suid, self.storage_bytes[t.suid])

    def bind(self, t: TensorArg, x: torch.Tensor) -> None:
        """Record ``x`` as tensor ``t`` without accounting (an extension accounts it)."""
        self.tensors[t.uid] = x

    def unbind(self, suid: int) -> None:
        """Drop every tensor an extension bound on storage ``suid`` (no accounting)."""
        tensors = self.tensors
        for uid in self.uids_by_suid[suid]:
            tensors[uid] = None

    def free(self, suid: int) -> int:
        """Drop every tensor on a storage generation unless it is pinned; returns the
        accounted bytes released."""
        return 0 if suid in self.pinned else self.drop(suid)

    def free_all(self) -> int:
        """Free every held storage that is not pinned (a flush, or the end of an iteration)."""
        return sum(self.free(s) for s, nbytes in enumerate(self.memory.held) if nbytes)


def _dropper(tensors: list, uids_by_suid, bases: dict, release):
    """``TensorStore.drop`` over the store's tables, bound once: it runs after most ops, and
    a closure's variables cost less than the attribute lookups a method repeats."""
    def drop(suid: int) -> int:
        for uid in uids_by_suid[suid]:
            tensors[uid] = None
        if suid in bases:
            del bases[suid]
        return release(suid)
    return drop
