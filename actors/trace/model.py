"""The compact, typed trace model: what the replay needs of one rank's Execution Trace.

Every class uses ``__slots__`` so a trace of 10^6 nodes fits in memory. Tensors carry two
dense ids assigned in execution order at load time:

* ``uid``  - one logical tensor (the trace's tensor ids are reused by the allocator, so the
  raw ``(tensor_id, storage_id, offset, numel, itemsize)`` tuple is not unique over time);
* ``suid`` - one *generation* of a storage: a storage id starts a new generation whenever
  an op allocates a fresh output on it (unaliased return in the op schema) or a tensor of
  another dtype shows up on it. Views share their base's ``suid``.

Dense ids let the replay keep its registries in plain lists.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from actors.trace.dtypes import itemsize_of


class TensorArg:
    """A tensor argument: the trace's tensor tuple plus shape, strides and dtype."""

    __slots__ = ("tensor_id", "storage_id", "offset", "numel", "itemsize", "device",
                 "shape", "stride", "dtype", "uid", "suid")

    def __init__(self, tensor_id, storage_id, offset, numel, itemsize, device,
                 shape, stride, dtype):
        self.tensor_id = tensor_id
        self.storage_id = storage_id
        self.offset = offset  # in elements, not bytes
        self.numel = numel
        self.itemsize = itemsize
        self.device = device
        self.shape = shape  # tuple[int, ...]
        self.stride = stride  # tuple[int, ...] or None (schemas before 1.1.1)
        self.dtype = dtype  # torch dtype name, e.g. "float32"
        self.uid = -1
        self.suid = -1

    @property
    def extent_elems(self) -> int:
        """Elements of storage this view reaches, counting its offset."""
        if self.numel == 0:
            return self.offset
        if self.stride is None or len(self.stride) != len(self.shape):
            return self.offset + self.numel
        reach = 1
        for size, step in zip(self.shape, self.stride):
            if size == 0:
                return self.offset
            reach += (size - 1) * abs(step)
        return self.offset + reach

    def __repr__(self):
        return (f"TensorArg(id={self.tensor_id}, storage={self.storage_id}, shape={self.shape}, "
                f"dtype={self.dtype}, uid={self.uid}, suid={self.suid})")


class Arg:
    """A non-tensor argument, or a list of tensors.

    ``kind`` is one of: ``int``, ``float``, ``bool``, ``str``, ``none``, ``device``,
    ``int_list``, ``float_list``, ``bool_list``, ``tensor_list`` (value: tuple of TensorArg
    or None), ``list`` (mixed/other), ``object`` (an opaque script object such as a process
    group), ``tuple`` and ``unknown``.
    """

    __slots__ = ("kind", "value", "type_str")

    def __init__(self, kind: str, value, type_str: str = ""):
        self.kind = kind
        self.value = value
        self.type_str = type_str

    def __repr__(self):
        return f"Arg({self.kind}, {self.value!r})"


class Op:
    """One top-level operator in execution order (its nested children are not replayed)."""

    __slots__ = ("index", "node_id", "name", "schema", "inputs", "outputs", "tensor_ranges",
                 "module", "step", "collective", "tid", "rf_id")

    def __init__(self, index, node_id, name, schema, inputs, outputs, tensor_ranges, module,
                 step, collective, tid, rf_id=None):
        self.index = index  # position in Trace.ops
        self.node_id = node_id
        self.name = name  # e.g. "aten::addmm"
        self.schema = schema  # op schema string ("" when the trace has none)
        self.inputs = inputs  # tuple[TensorArg | Arg, ...]
        self.outputs = outputs  # tuple[TensorArg | Arg, ...]
        self.tensor_ranges = tensor_ranges  # {input position: (lo, hi)} or None
        self.module = module  # innermost enclosing record_function range ("" if none)
        self.step = step  # index into Trace.steps, or -1 outside any ProfilerStep window
        self.collective = collective  # Collective | None
        self.tid = tid  # recording thread (autograd runs on its own thread)
        # record-function id: the profiler (Kineto) trace of the same iteration carries it as
        # args["Record function id"] on the op's cpu_op event (None in traces without it)
        self.rf_id = rf_id

    def input_tensors(self):
        """Every TensorArg among the inputs, lists flattened."""
        return _flatten_tensors(self.inputs)

    def output_tensors(self):
        """Every TensorArg among the outputs, lists flattened."""
        return _flatten_tensors(self.outputs)

    def __repr__(self):
        return f"Op(#{self.index} node={self.node_id} {self.name})"


def _flatten_tensors(args):
    out = []
    for a in args:
        if type(a) is TensorArg:
            out.append(a)
        elif a.kind == "tensor_list":
            out.extend(t for t in a.value if t is not None)
    return out


class Collective:
    """One collective call, normalized from either trace shape.

    NCCL-style traces carry ``record_param_comms`` nodes with comm attributes; gloo traces
    only show the ``c10d::*`` op, so sizes come from its tensor arguments and the process
    group is unknown (``pg_name`` None) unless determinable.
    """

    __slots__ = ("kind", "pg_name", "pg_desc", "dtype", "in_nelems", "out_nelems",
                 "in_splits", "out_splits", "rank_start", "rank_stride", "group_size",
                 "seq", "wait_seq", "root", "async_op", "source")

    def __init__(self, kind, *, pg_name=None, pg_desc=None, dtype=None, in_nelems=0,
                 out_nelems=0, in_splits=(), out_splits=(), rank_start=None, rank_stride=None,
                 group_size=None, seq=None, wait_seq=None, root=None, async_op=None, source=""):
        self.kind = kind  # see actors.trace.collectives.KINDS
        self.pg_name = pg_name
        self.pg_desc = pg_desc
        self.dtype = dtype  # torch dtype name
        self.in_nelems = in_nelems
        self.out_nelems = out_nelems
        self.in_splits = tuple(in_splits)
        self.out_splits = tuple(out_splits)
        self.rank_start = rank_start
        self.rank_stride = rank_stride
        self.group_size = group_size
        self.seq = seq  # sequence number of an async call (record_param_comms)
        self.wait_seq = wait_seq  # for kind "wait": the seq it completes
        self.root = root
        # Issued async: the trace's async_op flag, else whether a later wait completes it
        # (settled at load time; None only for waits).
        self.async_op = async_op
        self.source = source  # "record_param_comms" | "c10d" | "functional"

    @property
    def in_bytes(self) -> int:
        return self.in_nelems * itemsize_of(self.dtype)

    def signature(self) -> tuple:
        """What must agree across the member ranks of a group, position by position."""
        return (self.kind, self.in_nelems, self.out_nelems, self.dtype)

    def __repr__(self):
        return (f"Collective({self.kind}, pg={self.pg_name}, dtype={self.dtype}, "
                f"in={self.in_nelems}, out={self.out_nelems})")


# Ranks in a job, at most: no job is larger, and the checks build per-rank tables, so a
# trace or file name claiming more is refused before anything that large is built.
MAX_WORLD_SIZE = 1 << 20


@dataclass(frozen=True)
class ProcessGroupInfo:
    """One entry of the trace's ``## process_group:init ##`` table."""

    name: str
    desc: str
    backend: str
    ranks: tuple[int, ...]  # () means all ranks
    group_size: int


@dataclass(frozen=True)
class Step:
    """A ``ProfilerStep#N`` window: ops[first:end]."""

    name: str
    first: int
    end: int


@dataclass
class Trace:
    """One rank's trace."""

    path: str
    schema: str
    num_nodes: int
    ops: list[Op]
    process_groups: list[ProcessGroupInfo]
    steps: list[Step]
    num_tensors: int  # number of distinct uids
    num_storages: int  # number of distinct suids
    rank: int | None = None  # from the file name when it follows rank-<r>.*
    meta: dict = field(default_factory=dict)
    # suids first used as an input that an op nested in another op made earlier in the
    # iteration (actors/trace/made_inside.py; and FSDP2 unsharded parameters re-filled after a
    # storage resize, actors/trace/tensor_ids.py): not alive before it, though they look so
    made_inside: frozenset = frozenset()
    # when memory only nested ops touch is alive: (suid or -1, start op, end op, bytes)
    # (actors/trace/nested_lifetimes.py)
    nested_lifetimes: tuple = ()
    # (suid, op index, made in the step): the run freed the storage after that op (a fake
    # capture's recorded frees, actors/trace/recorded_frees.py); empty for traces without them
    recorded_frees: tuple = ()
    # storage generations the step keeps in host memory (a GPU target's save_on_cpu copies:
    # actors/trace/conventions.py, HOST_STORAGE_OP); empty for traces without them
    host_storages: frozenset = frozenset()
    # (node id, qualname, kind) of each module backward marker inside the op span, in id order
    # (kind bwd_begin / bwd_end: actors/trace/conventions.py); ZeRO-3 places them between ops
    backward_marks: tuple = ()

    @property
    def collectives(self) -> list[Op]:
        return [op for op in self.ops if op.collective is not None]
