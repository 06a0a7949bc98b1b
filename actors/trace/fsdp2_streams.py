"""Which storages FSDP2 allocates on its side streams (pure data, for the allocator model).

The CUDA caching allocator caches a freed block for the stream that allocated it only, so
memory a side stream cached is not reused by the compute stream's activations
(actors/replay/memory/cuda_allocator.py). FSDP2 (torch/distributed/fsdp/_fully_shard/
_fsdp_collectives.py) allocates two kinds of storages on side streams:

* ``foreach_all_gather`` runs under ``all_gather_copy_in_stream``: the low-precision copies of
  the shards and the flat all-gather output (a unit's whole gathered size: 0.41 GiB for a
  Llama 3 8B block in bf16, 1.96 GiB for its root's embeddings and output projection);
* ``foreach_reduce`` allocates the reduce-scatter output under ``reduce_scatter_stream``: the
  flat sharded gradient the parameters' ``.grad`` views, alive until ``zero_grad`` frees it
  (the reduce-scatter input is allocated on the compute stream).

The trace records no streams; the ranges FSDP2 opens name them: every storage first made by
an op in an ``FSDP::all_gather`` range, and the output of each reduce-scatter in an
``FSDP::post_backward_reduce`` range.
"""
from __future__ import annotations

from actors.trace.fsdp2_lifetimes import GATHER_RANGE, REDUCE_RANGE
from actors.trace.model import Op

COMPUTE_STREAM = 0
ALL_GATHER_COPY_IN_STREAM = 1
REDUCE_SCATTER_STREAM = 2


def _in_range(module: str, name: str) -> bool:
    """Whether record_function range ``module`` is ``name`` (the root's) or ``name (fqn)``."""
    return module == name or module.startswith(name + " (")


def side_stream_storages(ops: list[Op]) -> dict[int, int]:
    """suid -> the FSDP2 side stream that allocates it (storages not listed: the compute
    stream). A storage counts for the stream of the op that first uses it."""
    streams: dict[int, int] = {}
    seen: set[int] = set()
    for op in ops:
        if _in_range(op.module, GATHER_RANGE):
            for t in op.output_tensors():
                if t.suid >= 0 and t.suid not in seen:
                    streams[t.suid] = ALL_GATHER_COPY_IN_STREAM
        elif (op.collective is not None and op.collective.kind == "reduce_scatter_tensor"
              and _in_range(op.module, REDUCE_RANGE)):
            out = op.input_tensors()[:1]  # (Tensor output, Tensor input, ...)
            if out and out[0].suid >= 0:
                streams[out[0].suid] = REDUCE_SCATTER_STREAM
        for t in op.input_tensors():
            seen.add(t.suid)
        for t in op.output_tensors():
            seen.add(t.suid)
    return streams
