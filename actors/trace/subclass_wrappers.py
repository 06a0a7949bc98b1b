"""Tensor-subclass wrappers (DTensor, AsyncCollectiveTensor, torchao's float8 tensors): the
arguments that hold no memory of their own, and the ops left on them.

A wrapper subclass is made by ``_make_wrapper_subclass``: it has no storage, and the observer
writes every wrapper of a trace on one shared storage id (the null data pointer's), whatever its
shape. Seen in a real pipeline x tensor-parallel capture: the whole vocabulary's logits
(4 x 256 x 4096 floats), the output projection's weight and every block's activations on one id.
Read as a storage it was one tensor as large as the largest wrapper, live from the first wrapper
op to the last: 16 MiB the run never held, on a last stage that peaked at 96 MiB.

The subclass's own work is recorded under a ``PythonSubclass`` frame, whose tensor inputs are
the wrappers; the loader keeps the frame's ops in place of the wrapper op (on a composite op,
``linear`` into ``t`` and ``mm``, the frames lie under its nested ops). So a trace's wrapper
storage ids are those of the frames' tensor inputs that no op under a frame uses: the ops under a
frame work on local tensors, and a plain tensor passed to a subclass op is used there too.

A wrapper op that reached no frame (``to`` of a DTensor to the dtype it has, the pipeline
schedule's ``detach_`` of a stage's output, ``_wrap_tensor_autograd`` making an
AsyncCollectiveTensor) did no work and made no memory the trace shows: `drop_wrapper_ops` drops
every op with an argument on a wrapper storage.

An empty tensor has no data either, and the observer writes it on the same null pointer's id:
FSDP2's local shard of a parameter smaller than the world, an expert that got no token. Such a
tensor is real (an op on it runs), holds nothing, and is no wrapper: only tensors with elements
count here, so the null id is a wrapper storage by its wrappers, and an op on empty tensors is
kept.

Pure trace code: raw node values in.
"""
from __future__ import annotations

from actors.trace.made_inside import tensor_storage_ids


def add_tensor_storages(values, out: set[int]) -> None:
    """Add the storage id of every tensor with elements of an observer value list to ``out``
    (empty tensors are no wrappers: see the module docstring)."""
    tensor_storage_ids(values, out, with_elements=True)


def used_storages(sides) -> tuple[int, ...]:
    """The storage ids of the tensors with elements in an op's ``sides`` (its input and output
    values): what `drop_wrapper_ops` checks it by, read while the op's node is parsed."""
    out: set[int] = set()
    for values in sides:
        add_tensor_storages(values, out)
    return tuple(out)  # a tuple: one is kept per op


def drop_wrapper_ops(top_level: list, frame_inputs: set[int], under_frame: set[int]) -> int:
    """Drop (in place) from ``top_level`` (``[raw node, step, module, used_storages]`` per op)
    every op with an argument on a wrapper storage: ``frame_inputs`` are the storage ids of the
    ``PythonSubclass`` frames' tensor inputs, ``under_frame`` the ids of the nodes under a
    frame. Returns how many were dropped."""
    if not frame_inputs:
        return 0
    local: set[int] = set()
    for raw, _, _, used in top_level:
        if raw["id"] in under_frame:
            local.update(used)
    wrappers = frame_inputs - local
    if not wrappers:
        return 0
    kept = [entry for entry in top_level if wrappers.isdisjoint(entry[3])]
    num_dropped = len(top_level) - len(kept)
    top_level[:] = kept
    return num_dropped
