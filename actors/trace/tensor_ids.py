"""Assign dense tensor (`uid`) and storage-generation (`suid`) ids in execution order.

The trace's ids are reused: the caching allocator hands the same storage to a later tensor,
possibly of another dtype, and tensor ids are recycled too. A storage id therefore starts a
new *generation* when an op returns a freshly allocated tensor on it (a return without an
alias annotation in the op schema) or when a tensor of another dtype appears on it. Keying
the replay on generations keeps an index tensor from ever reading another dtype's bytes.

Meta captures never reuse an address (actors/capture/meta_storage.py): there a fresh return on
a storage already seen is that same allocation handed back, e.g. an output selective
activation checkpointing kept in forward and returns again in its recompute, and it stays in
its generation.
"""
from __future__ import annotations

from actors.trace.model import Op, TensorArg
from actors.trace.op_schema import fresh_return_positions


class TensorIdAssigner:
    """Walks ops in order and stamps `uid`/`suid` on every TensorArg."""

    def __init__(self):
        self._uids: dict[tuple, int] = {}
        self._storage: dict[int, tuple[int, str]] = {}  # storage_id -> (suid, dtype)
        self.num_tensors = 0
        self.num_storages = 0

    def assign(self, op: Op) -> None:
        inputs = op.input_tensors()
        for t in inputs:
            self._stamp(t, fresh=False)
        # An output on a storage one of the op's own inputs lives on is a view of it, whatever
        # the schema says (composite ops such as unflatten_dense_tensors return views without
        # alias annotations): the allocator cannot hand out a storage that is still in use.
        input_storages = {t.storage_id for t in inputs if t.storage_id}
        # Collective outputs are their (in-place) inputs even where the schema omits the alias.
        fresh = () if op.collective is not None and op.collective.source != "functional" \
            else fresh_return_positions(op.schema)
        for i, arg in enumerate(op.outputs):
            is_fresh = fresh[i] if i < len(fresh) else False
            if type(arg) is TensorArg:
                self._stamp(arg, is_fresh and arg.storage_id not in input_storages)
            elif arg.kind == "tensor_list":
                for t in arg.value:
                    if t is not None:
                        self._stamp(t, is_fresh and t.storage_id not in input_storages)

    def _stamp(self, t: TensorArg, fresh: bool) -> None:
        current = self._storage.get(t.storage_id)
        if (fresh and t.device != "meta") or current is None or current[1] != t.dtype:
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
