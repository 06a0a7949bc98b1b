"""The parameters ZeRO-3 partitions: detected storages of a trace, with their uses and views.

A parameter here is a storage generation (``suid``) that ``param_like_storages`` detects (see
actors/trace/stats.py; mixed-precision weights refreshed by ``copy_`` count). Parameters that
share one flat buffer are one parameter, as they are one storage. Its views are the tensors of
the trace that first appear as op inputs on that storage: the replay binds them to the
gathered data; views that ops make of it (``aten::t`` of a weight) the ops make again.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from actors.errors import ConfigError
from actors.trace.liveness import Liveness
from actors.trace.model import TensorArg, Trace
from actors.trace.stats import param_like_storages


@dataclass
class Param:
    """One parameter storage of the trace."""

    suid: int
    index: int  # position in order of first use (what zero3.modules_by=order counts)
    numel: int  # elements of the storage its views reach
    dtype: str  # torch dtype name, e.g. "float32"
    itemsize: int
    tensor_ids: tuple[int, ...]  # the trace's tensor ids of its views
    views: list[TensorArg] = field(default_factory=list)  # bound at every fetch
    uses: list[int] = field(default_factory=list)  # op indices touching it, increasing

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    def __repr__(self):
        return f"Param(#{self.index} suid={self.suid} {self.dtype}[{self.numel}])"


def discover_params(trace: Trace, liveness: Liveness) -> list[Param]:
    """The trace's parameters in order of first use."""
    suids = set(param_like_storages(trace, liveness.storage_external))
    found: dict[int, Param] = {}
    seen_uids: set[int] = set()
    for op in trace.ops:
        for is_input, tensors in ((True, op.input_tensors()), (False, op.output_tensors())):
            for t in tensors:
                if t.suid not in suids:
                    continue
                p = found.get(t.suid)
                if p is None:
                    itemsize = t.itemsize or 1
                    p = found[t.suid] = Param(
                        suid=t.suid, index=len(found), dtype=t.dtype, itemsize=itemsize,
                        numel=-(-liveness.storage_bytes[t.suid] // itemsize), tensor_ids=())
                if not p.uses or p.uses[-1] != op.index:
                    p.uses.append(op.index)
                if t.uid not in seen_uids:
                    seen_uids.add(t.uid)
                    if is_input:  # a view the trace had before this op; outputs are re-made
                        p.views.append(t)
    for p in found.values():
        p.tensor_ids = tuple(sorted({v.tensor_id for v in p.views}))
    return list(found.values())


def params_by_ref(params: list[Param], refs: list[int], by: str, module: str) -> list[Param]:
    """The parameters ``refs`` names (by trace tensor id or by order) for ``zero3.modules``."""
    if by == "order":
        lookup = {p.index: p for p in params}
    else:
        lookup = {tid: p for p in params for tid in p.tensor_ids}
    missing = [r for r in refs if r not in lookup]
    if missing:
        known = (f"orders 0..{len(params) - 1}" if by == "order" else
                 "tensor ids " + ", ".join(str(t) for p in params[:8] for t in p.tensor_ids[:1]))
        raise ConfigError(f"zero3.modules[{module!r}]: no detected parameter with {by} "
                          f"{missing[:5]} in this trace ({len(params)} parameters; {known}...)")
    out: list[Param] = []
    for r in refs:
        if lookup[r] not in out:
            out.append(lookup[r])
    return out
