"""Assign dense tensor (`uid`) and storage-generation (`suid`) ids in execution order.

The trace's ids are reused: the caching allocator hands the same storage to a later tensor,
possibly of another dtype, and tensor ids are recycled too. A storage id therefore starts a
new *generation* when an op returns a freshly allocated tensor on it (a return without an
alias annotation in the op schema) or when a tensor of another dtype appears on it. Keying
the replay on generations keeps an index tensor from ever reading another dtype's bytes.

FSDP2 frees an unsharded parameter by resizing its storage to 0 bytes and brings it back by
resizing it again before the all-gather's copy-out writes it (``UntypedStorage.resize_`` is
no op the trace records): every storage in the ``out`` list of an ``fsdp::split_with_sizes_copy``
starts a new generation at its first use in that copy-out (the views FSDP2 makes of it right
before the copy), which lives until its last use, as the unsharded parameter does between one
all-gather and its reshard.

FSDP1 does the same with a unit's padded flat parameter (``_free_storage`` / ``_alloc_storage``
resize it): after the forward (FULL_SHARD, HYBRID_SHARD) and after the backward, and before each
all-gather that fills it, which is the first use of each of its lives; with MixedPrecision, also
with the low-precision shard it gathers from (``_mp_shard``: filled by a ``copy_`` from the
full-precision shard before each all-gather, freed after it). Every output storage of an
all-gather inside FSDP1's ``FullyShardedDataParallel.*`` ranges starts a new generation there:
the unsharded parameters live from their all-gather to their last use (FULL_SHARD: the block's
forward, then again in backward), and are made in the iteration, not held from before it.
SHARD_GRAD_OP gathers once, in forward, and keeps the one generation through backward.

A storage id an op nested inside another allocated again after its last top-level use (as an
input) also starts a new generation there: the composite op made a new tensor on the reused
storage (actors/trace/made_inside.py), which the next top-level op reads; without the split,
the old tensor would seem to live on until then.

Meta and fake captures never reuse an address (actors/capture/fake/meta_storage.py; a fake trace
says so with UNIQUE_STORAGES_KEY): there a fresh return on
a storage already seen is that same allocation handed back, e.g. an output selective
activation checkpointing kept in forward and returns again in its recompute, and it stays in
its generation.
"""
from __future__ import annotations

import bisect

from actors.trace.model import Op, TensorArg
from actors.trace.op_schema import fresh_return_positions


# Top-level key of a trace whose capture gave every allocation an address never seen before.
UNIQUE_STORAGES_KEY = "tracefleet_unique_storages"


class TensorIdAssigner:
    """Walks ops in order and stamps `uid`/`suid` on every TensorArg."""

    def __init__(self, refill_starts: dict[int, frozenset] | None = None,
                 nested_allocations: dict[int, list[int]] | None = None,
                 unique_storages: bool = False):
        """``refill_starts``: op index -> storage ids a new generation starts at (see
        :func:`refill_starts`); ``nested_allocations``: storage id -> increasing node ids of
        nested ops that allocated on it (actors/trace/made_inside.py); ``unique_storages``:
        the capture never handed an address out twice (fake captures, UNIQUE_STORAGES_KEY),
        as on meta."""
        self.unique = unique_storages
        self._refill_starts = refill_starts or {}
        self._nested = nested_allocations or {}
        # storage id -> (node id of its last top-level use, whether that op returned it)
        self._last: dict[int, tuple[int, bool]] = {}
        self._uids: dict[tuple, int] = {}
        self._storage: dict[int, tuple[int, str]] = {}  # storage_id -> (suid, dtype)
        self.num_tensors = 0
        self.num_storages = 0
        # generations an op re-filled (first seen as its input, yet made in the iteration)
        self.refilled: set[int] = set()

    def assign(self, op: Op) -> None:
        inputs = op.input_tensors()
        refilled = self._refill_starts.get(op.index, ())
        started = set()
        last, nested, node_id = self._last, self._nested, op.node_id
        for t in inputs:
            sid = t.storage_id
            restart = sid in refilled and sid not in started
            self._stamp(t, fresh=sid in nested and sid not in started
                        and self._remade_inside(sid, node_id), refill=restart)
            if restart:
                self.refilled.add(t.suid)
            started.add(sid)
        # An output on a storage one of the op's own inputs lives on is a view of it, whatever
        # the schema says (composite ops such as unflatten_dense_tensors return views without
        # alias annotations): the allocator cannot hand out a storage that is still in use.
        input_storages = {t.storage_id for t in inputs if t.storage_id}
        # Collective outputs are their (in-place) inputs even where the schema omits the alias.
        in_place = op.collective is not None and op.collective.source != "functional"
        fresh = () if in_place else fresh_return_positions(op.schema)
        for i, arg in enumerate(op.outputs):
            # An output on no input's storage is new memory even where the schema says it may
            # alias (``aten::to`` converting, ``contiguous`` copying): the allocator handed the
            # op a storage, perhaps one a freed tensor had.
            is_fresh = not in_place or (fresh[i] if i < len(fresh) else False)
            if type(arg) is TensorArg:
                self._stamp(arg, is_fresh and arg.storage_id not in input_storages)
            elif arg.kind == "tensor_list":
                for t in arg.value:
                    if t is not None:
                        self._stamp(t, is_fresh and t.storage_id not in input_storages)
        for sid in input_storages:
            last[sid] = (node_id, False)
        for t in op.output_tensors():
            if t.storage_id:
                last[t.storage_id] = (node_id, True)

    def current_suid(self, storage_id: int) -> int | None:
        """The generation storage ``storage_id`` is on after the ops assigned so far."""
        current = self._storage.get(storage_id)
        return None if current is None else current[0]

    def _remade_inside(self, sid: int, node_id: int) -> bool:
        """Whether a nested op allocated on storage ``sid`` after its last top-level use (an
        input, not an output whose own making the nested ops were) and before ``node_id``."""
        prev = self._last.get(sid)
        if prev is None or prev[1]:
            return False
        ids = self._nested[sid]
        k = bisect.bisect_right(ids, prev[0])
        return k < len(ids) and ids[k] < node_id

    def _stamp(self, t: TensorArg, fresh: bool, refill: bool = False) -> None:
        """``refill``: a new generation whatever the capture (FSDP2 re-allocates the same
        storage by resizing it, on meta and fake too)."""
        current = self._storage.get(t.storage_id)
        if refill or (fresh and not self.unique and t.device != "meta") or current is None \
                or current[1] != t.dtype:
            current = (self.num_storages, t.dtype)
            self._storage[t.storage_id] = current
            self.num_storages += 1
        t.suid = current[0]
        key = (t.tensor_id, t.suid, t.offset, t.numel, t.itemsize, t.shape, t.stride)
        uid = self._uids.get(key)
        if uid is None:
            uid = self._uids[key] = self.num_tensors
            self.num_tensors += 1
        t.uid = uid


# Ops writing whole storages their caller has just re-allocated in place (see the docstring).
_REFILLING = frozenset({"fsdp::split_with_sizes_copy"})
# FSDP1's all-gathers (within its FullyShardedDataParallel.* ranges) write a unit's whole padded
# flat parameter, re-allocated in place (see the docstring).
FSDP1_RANGE = "FullyShardedDataParallel."
_GATHERS = frozenset({"all_gather", "all_gather_into_tensor"})


def _storage_extents(ops: list[Op]) -> dict[int, int]:
    """Storage id -> the furthest element (offset + numel) any tensor on it reaches."""
    extent: dict[int, int] = {}
    for op in ops:
        for t in op.input_tensors() + op.output_tensors():
            if t.storage_id:
                end = t.offset + t.numel
                if end > extent.get(t.storage_id, 0):
                    extent[t.storage_id] = end
    return extent


def _writes_whole_storage(op: Op, extent: dict[int, int]) -> bool:
    """Whether a copy_'s destination is its whole storage (everything the trace shows of it)."""
    inputs = op.input_tensors()
    if not inputs or not inputs[0].storage_id:
        return False
    dest = inputs[0]
    return dest.offset == 0 and dest.numel == extent.get(dest.storage_id, -1)


def _copied_into(window: list[Op], gather: Op) -> set[int]:
    """Storages of the gather's inputs that an ``aten::copy_`` in ``window`` (the ops of the
    gather's range before it) writes as its destination: FSDP1's ``_mp_shard``, re-allocated
    and filled from the full-precision shard before every all-gather, freed after it. A gather
    of the parameter's own shard (no MixedPrecision) has no such copy and keeps its storage."""
    gathered = {t.storage_id for t in gather.input_tensors()} - {
        t.storage_id for t in gather.output_tensors()}
    written = set()
    for op in window:
        if op.name == "aten::copy_" and op.input_tensors():
            written.add(op.input_tensors()[0].storage_id)
    return gathered & written


def refill_starts(ops: list[Op]) -> dict[int, frozenset]:
    """Op index -> storage ids whose new generation starts there: per re-filling op (FSDP2's
    copy-out, FSDP1's all-gather), each storage it fills (the copy-out's tensor-list arguments,
    the all-gather's outputs) at its first use among the ops of the same module range right
    before it (the copy-out's views, the chunks FSDP1 gathers into), else at the op."""
    starts: dict[int, set] = {}
    extent = None  # a pass over every tensor: only for traces with FSDP1's copies
    for op in ops:
        if op.name == "aten::copy_" and op.module.startswith(FSDP1_RANGE):
            extent = _storage_extents(ops) if extent is None else extent
            if _writes_whole_storage(op, extent):
                # FSDP1's low-precision parameter made again with no gather to follow (a shard
                # group of one: NO_SHARD, HYBRID_SHARD within one rank): its first use
                starts.setdefault(op.index, set()).add(op.input_tensors()[0].storage_id)
            continue
        if op.collective is not None and op.collective.kind in _GATHERS \
                and op.module.startswith(FSDP1_RANGE):
            pending = {t.storage_id for t in op.output_tensors() if t.storage_id}
        elif op.name in _REFILLING:
            pending = {t.storage_id for arg in op.inputs if type(arg) is not TensorArg
                       and arg.kind == "tensor_list" for t in arg.value
                       if t is not None and t.storage_id}
        else:
            continue
        first = op.index  # FSDP1 chunks the padded storage into the gather's outputs first
        while first > 0 and ops[first - 1].module == op.module and ops[first - 1].name not in _REFILLING:
            first -= 1
        if op.collective is not None:  # FSDP1 with MixedPrecision gathers its low-precision
            pending |= _copied_into(ops[first:op.index], op)  # shard, made again each time
        for i in range(first, op.index + 1):
            hit = pending & {t.storage_id for t in ops[i].input_tensors()}
            if hit:
                starts.setdefault(i, set()).update(hit)
                pending -= hit
    return {i: frozenset(v) for i, v in starts.items()}
