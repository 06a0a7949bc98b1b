"""Normalize collective calls from both trace shapes into `Collective` records.

* NCCL traces: a ``record_param_comms`` node carries the collective name, dtype, element
  counts, split sizes, rank start/stride and the process group (attrs since schema 1.1.0;
  only positional inputs before that). It is usually the child of a ``c10d::*`` op.
* gloo traces: only the ``c10d::*`` op exists, with the group shown as ``"<Object>"``; the
  sizes come from its tensor arguments, named by the op schema.
* functional collectives (``_c10d_functional::*``) name their group as a string argument;
  so do ``c10d::*`` ops of an N-D mesh captured on fake, whose ProcessGroup argument the
  capture wrote as the group's name (actors/capture/fake/group_names.py).
"""
from __future__ import annotations

import orjson

from actors.trace.dtypes import C10_NAME_TO_DTYPE
from actors.trace.model import MAX_WORLD_SIZE, Arg, Collective, TensorArg

KINDS = ("all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor",
         "all_gather_into_tensor_coalesced", "reduce_scatter", "reduce_scatter_tensor",
         "reduce_scatter_tensor_coalesced", "all_to_all", "all_to_all_single", "broadcast",
         "reduce", "gather", "scatter", "barrier", "send", "recv", "wait")

C10D_KINDS = {
    "c10d::allreduce_": "all_reduce",
    "c10d::allreduce_coalesced_": "all_reduce_coalesced",
    "c10d::allgather_": "all_gather",
    "c10d::allgather_coalesced_": "all_gather",
    "c10d::_allgather_base_": "all_gather_into_tensor",
    "c10d::allgather_into_tensor_coalesced_": "all_gather_into_tensor_coalesced",
    "c10d::reduce_scatter_": "reduce_scatter",
    "c10d::_reduce_scatter_base_": "reduce_scatter_tensor",
    "c10d::reduce_scatter_tensor_coalesced_": "reduce_scatter_tensor_coalesced",
    "c10d::alltoall_": "all_to_all",
    "c10d::alltoall_base_": "all_to_all_single",
    "c10d::broadcast_": "broadcast",
    "c10d::reduce_": "reduce",
    "c10d::gather_": "gather",
    "c10d::scatter_": "scatter",
    "c10d::barrier": "barrier",
    "c10d::send": "send",
    "c10d::recv_": "recv",
    "c10d::recv_any_source_": "recv",
    "_c10d_functional::all_reduce": "all_reduce",
    "_c10d_functional::all_reduce_": "all_reduce",
    "_c10d_functional::all_gather_into_tensor": "all_gather_into_tensor",
    "_c10d_functional::reduce_scatter_tensor": "reduce_scatter_tensor",
    "_c10d_functional::all_to_all_single": "all_to_all_single",
    "_c10d_functional::broadcast": "broadcast",
    "_c10d_functional::broadcast_": "broadcast",
    "_c10d_functional::wait_tensor": "wait",
}

# Eager functional collectives do their work by calling a c10d op (recorded as their child).
FUNCTIONAL = frozenset(n for n in C10D_KINDS if n.startswith("_c10d_functional::"))
FUNCTIONAL_WAITS = frozenset(n for n in FUNCTIONAL if C10D_KINDS[n] == "wait")
FUNCTIONAL_CALLS = FUNCTIONAL - FUNCTIONAL_WAITS

# collective_name as written by record_param_comms (NCCL and gloo backends, all schemas).
RPC_KINDS = {
    "allreduce": "all_reduce", "all_reduce": "all_reduce",
    "allreduce_coalesced": "all_reduce_coalesced",
    "allgather": "all_gather", "all_gather": "all_gather",
    "allgather_coalesced": "all_gather",
    "_allgather_base": "all_gather_into_tensor", "all_gather_into_tensor": "all_gather_into_tensor",
    "allgather_into_tensor_coalesced": "all_gather_into_tensor_coalesced",
    "reduce_scatter": "reduce_scatter",
    "_reduce_scatter_base": "reduce_scatter_tensor", "reduce_scatter_tensor": "reduce_scatter_tensor",
    "reduce_scatter_tensor_coalesced": "reduce_scatter_tensor_coalesced",
    "all_to_all": "all_to_all_single", "all_to_allv": "all_to_all_single",
    "alltoall": "all_to_all", "alltoall_base": "all_to_all_single",
    "broadcast": "broadcast", "reduce": "reduce", "gather": "gather", "scatter": "scatter",
    "barrier": "barrier", "send": "send", "recv": "recv", "recvAnySource": "recv",
    "wait": "wait",
}

_IN_NAMES = ("tensors", "input_tensors", "input", "inputs", "input_tensor", "input_list",
             "tensor", "self")
_OUT_NAMES = ("output_tensors", "output", "outputs", "output_tensor", "output_lists")
_ROOT_NAMES = ("root_rank", "rootRank", "src", "root")
_PEER_NAMES = ("dstRank", "srcRank", "dst")
_ASYNC_NAMES = ("async_op", "asyncOp")


def _numel(args) -> int:
    total = 0
    for a in args:
        if type(a) is TensorArg:
            total += a.numel
        elif a.kind == "tensor_list":
            total += sum(t.numel for t in a.value if t is not None)
    return total


def _first_dtype(args):
    for a in args:
        if type(a) is TensorArg:
            return a.dtype
        if a.kind == "tensor_list":
            for t in a.value:
                if t is not None:
                    return t.dtype
    return None


def _int_value(arg):
    return arg.value if type(arg) is Arg and arg.kind == "int" else None


def from_c10d(name: str, arg_names: list[str], inputs: tuple, outputs: tuple = ()) -> Collective:
    """Build a Collective from a ``c10d::*`` / ``_c10d_functional::*`` op's arguments.

    Sizes come from the arguments the op schema names (``input_tensors``, ``output``, ...);
    an op without an output argument (functional collectives return their result) is sized
    by its recorded ``outputs``.
    """
    kind = C10D_KINDS[name]
    functional = name.startswith("_c10d_functional::")
    by_name = dict(zip(arg_names, inputs))
    group = by_name.get("group_name") or by_name.get("process_group")
    pg_name = group.value if group is not None and group.kind == "str" else None
    if kind == "wait":  # completes a call; carries no message of its own (as record_param_comms)
        return Collective(kind, pg_name=pg_name, source="functional" if functional else "c10d")
    ins = [by_name[n] for n in _IN_NAMES if n in by_name]
    outs = [by_name[n] for n in _OUT_NAMES if n in by_name]
    in_nelems = _numel(ins[:1])
    out_nelems = _numel(outs[:1]) if outs else (_numel(outputs) or in_nelems)
    root = next((_int_value(by_name[n]) for n in _ROOT_NAMES + _PEER_NAMES if n in by_name), None)
    splits = {}
    for key in ("input_split_sizes", "output_split_sizes"):
        a = by_name.get(key)
        splits[key] = tuple(a.value) if a is not None and a.kind in ("int_list", "list") else ()
    group_size = _int_value(by_name["group_size"]) if "group_size" in by_name else None
    # On a non-root rank, scatter's input list is empty: the dtype is then the output's.
    dtype = _first_dtype(ins[:1]) or _first_dtype(outs[:1]) or _first_dtype(outputs)
    # point-to-point calls run async: pipelining posts them as isend/irecv in batches, and a
    # replay that waited for each send could block on a peer still posting its own send
    async_op = True if functional or kind in ("send", "recv") else _async_arg(by_name)
    return Collective(kind, pg_name=pg_name, dtype=dtype,
                      in_nelems=in_nelems, out_nelems=out_nelems,
                      in_splits=splits["input_split_sizes"], out_splits=splits["output_split_sizes"],
                      group_size=group_size, root=root, async_op=async_op,
                      source="functional" if functional else "c10d")


def _async_arg(by_name: dict):
    """The op's recorded ``async_op``/``asyncOp`` flag (newer c10d schemas), else None."""
    for key in _ASYNC_NAMES:
        a = by_name.get(key)
        if a is not None and a.kind == "bool":
            return bool(a.value)
    return None


def _split_attr(value) -> tuple:
    if isinstance(value, str):
        try:
            value = orjson.loads(value) if value else []
        except orjson.JSONDecodeError:
            return ()
    return tuple(value) if isinstance(value, list) else ()


def from_record_param_comms(inputs: tuple, attrs: dict, outputs: tuple = ()) -> Collective:
    """Build a Collective from a ``record_param_comms`` node (any schema version).

    Inputs are ``[tensors, seq, pg, rank, collective_name, in_split, out_split, ...]``, or
    ``[seq, pg, rank, "wait", ...]`` for waits; ``outputs`` holds the output tensor(s).
    Attributes (1.1.0+) win where present.
    """
    name_pos = next((i for i, a in enumerate(inputs)
                     if type(a) is Arg and a.kind == "str" and a.value in RPC_KINDS), None)
    raw_name = attrs.get("collective_name") or (inputs[name_pos].value if name_pos is not None else "")
    kind = RPC_KINDS.get(raw_name)
    if kind is None:
        raise ValueError(f"unknown record_param_comms collective_name {raw_name!r}")
    first_int = next((a.value for a in inputs if type(a) is Arg and a.kind == "int"), None)
    tensors = [a for a in inputs[:1] if type(a) is TensorArg or a.kind == "tensor_list"]
    pg_name = attrs.get("pg_name")
    pg_desc = attrs.get("pg_desc")
    if pg_name is None:
        pg = next((a for a in inputs if type(a) is Arg and a.kind == "tuple"), None)
        if pg is not None and len(pg.value) == 2 and isinstance(pg.value[0], str):
            pg_name, pg_desc = pg.value
    if pg_name == "":  # waits record an empty group: normalize both fields to "unknown"
        pg_name = pg_desc = None
    in_splits = _split_attr(attrs["in_split_size"]) if "in_split_size" in attrs else ()
    out_splits = _split_attr(attrs["out_split_size"]) if "out_split_size" in attrs else ()
    if not in_splits and name_pos is not None and len(inputs) > name_pos + 2:
        in_splits = tuple(inputs[name_pos + 1].value or ()) if inputs[name_pos + 1].kind in ("int_list", "list") else ()
        out_splits = tuple(inputs[name_pos + 2].value or ()) if inputs[name_pos + 2].kind in ("int_list", "list") else ()
    dtype = C10_NAME_TO_DTYPE.get(attrs.get("dtype")) or _first_dtype(tensors)
    in_nelems = attrs.get("in_msg_nelems", _numel(tensors))
    # Before 1.1.0 there is no out_msg_nelems attr: size the output from the node's output
    # tensor (an uneven all_to_allv receives a different count than it sends).
    out_nelems = attrs.get("out_msg_nelems", _numel(outputs) or in_nelems)
    is_wait = kind == "wait"
    return Collective(kind, pg_name=pg_name, pg_desc=pg_desc, dtype=None if is_wait else dtype,
                      in_nelems=0 if is_wait else in_nelems, out_nelems=0 if is_wait else out_nelems,
                      in_splits=in_splits, out_splits=out_splits,
                      rank_start=attrs.get("global_rank_start"),
                      rank_stride=attrs.get("global_rank_stride"), group_size=attrs.get("pg_size"),
                      seq=None if is_wait else first_int, wait_seq=first_int if is_wait else None,
                      source="record_param_comms")


def check(c: Collective) -> Collective:
    """``c`` when its fields have the types the replay and pre-flight compute with; ValueError
    naming the field otherwise (a malformed trace: counts and splits are summed, compared and
    sized from; sequence numbers are dict keys)."""
    for key in ("in_nelems", "out_nelems"):
        if not _count(getattr(c, key)):
            raise ValueError(f"{c.kind}: {key} {str(getattr(c, key))[:40]!r}; expected an integer >= 0")
    for key in ("in_splits", "out_splits"):
        splits = getattr(c, key)
        if len(splits) > MAX_WORLD_SIZE or not all(map(_count, splits)):
            raise ValueError(f"{c.kind}: {key} {str(splits)[:60]}; expected at most "
                             f"{MAX_WORLD_SIZE:,} integers >= 0")
    for key in ("group_size", "rank_start", "rank_stride", "root", "seq", "wait_seq"):
        value = getattr(c, key)
        if value is not None and type(value) is not int:
            raise ValueError(f"{c.kind}: {key} {str(value)[:40]!r}; expected an integer")
    for key in ("pg_name", "pg_desc", "dtype"):
        value = getattr(c, key)
        if value is not None and type(value) not in (str, int):
            raise ValueError(f"{c.kind}: {key} {str(value)[:40]!r}; expected a string")
    return c


def _count(x) -> bool:
    return type(x) is int and x >= 0


def merge(c10d: Collective, rpc: Collective, rpc_has_counts: bool) -> Collective:
    """A c10d op with its record_param_comms child: the op names the kind, the child the rest.

    ``rpc_has_counts``: the child carries ``in_msg_nelems``/``out_msg_nelems`` attrs (1.1.0+).
    Without them its counts are guesses from its own tensors (older schemas may record no
    output, and an all_gather or uneven all_to_allv receives a different count than it
    sends), so the c10d op's named input/output arguments win when they size anything.
    """
    rpc.kind = c10d.kind
    rpc.root = c10d.root
    rpc.async_op = c10d.async_op
    if not rpc.in_splits and not rpc.out_splits:
        rpc.in_splits, rpc.out_splits = c10d.in_splits, c10d.out_splits
    c10d_sized = c10d.in_nelems or c10d.out_nelems
    if not rpc.in_nelems or (not rpc_has_counts and c10d_sized):
        rpc.in_nelems, rpc.out_nelems = c10d.in_nelems, c10d.out_nelems
    rpc.dtype = rpc.dtype or c10d.dtype
    return rpc


def link_waits(ops) -> None:
    """Pair calls with the waits that complete them and settle every call's ``async_op``.

    record_param_comms calls and waits share a ``seq``; functional collectives complete via
    ``wait_tensor`` on their output tensor (keyed by its uid, so run after id assignment).
    A call whose trace records no ``async_op`` flag is async iff a later wait completes it.
    """
    pending: dict = {}  # seq -> the latest call issued with it
    for op in ops:
        c = op.collective
        if c is None:
            continue
        if c.source == "functional":
            tensors = op.input_tensors() if c.kind == "wait" else op.output_tensors()
            if tensors:
                key = ("uid", tensors[0].uid)
                if c.kind == "wait":
                    c.wait_seq = key
                else:
                    c.seq = key
        if c.kind != "wait":
            if c.seq is not None:
                pending[c.seq] = c
            continue
        call = pending.pop(c.wait_seq, None)
        if call is not None and call.async_op is None:
            call.async_op = True
    for op in ops:
        c = op.collective
        if c is not None and c.kind != "wait" and c.async_op is None:
            c.async_op = False
