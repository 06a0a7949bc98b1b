"""A rank's collective signature: what pre-flight compares across ranks, a few KB per rank.

It is computed where the trace is (a Ray task, a worker process, or in-process for small
folders) and the full trace is dropped there, so the driver's memory does not grow with the
traces' size. Per process group it holds the number of collectives, a digest of what must
agree across member ranks position by position (`comparable`), the first call (for
messages) and the all_to_all split sizes (cross-checked between ranks). When two ranks
disagree, `group_calls` reloads just those two to name the first differing call.

The sequences are exactly what the replay issues: the loader's ops (`actors.trace`), minus
waits and point-to-point send/recv, which are not part of a group's sequence.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import orjson

from actors.errors import TraceError
from actors.replay.comm.process_groups import resolve_pg_name
from actors.trace import Op, ProcessGroupInfo, Trace, load_trace
from actors.trace.source import TraceSource

NOT_IN_SEQUENCE = frozenset({"wait", "send", "recv"})
_ALL_TO_ALL = ("all_to_all", "all_to_all_single")


def comparable(c) -> tuple:
    """What must agree across the member ranks of a group for one call.

    all_to_all with split sizes: kind and dtype (the splits are cross-checked separately);
    gather: the input size, scatter: the output size (only the root holds the list side).
    """
    if c.kind in _ALL_TO_ALL and (c.in_splits or c.out_splits):
        return (c.kind, c.dtype)
    if c.kind == "gather":
        return (c.kind, c.dtype, c.in_nelems)
    if c.kind == "scatter":  # non-root ranks have no input list to take a dtype from
        return (c.kind, c.out_nelems)
    return c.signature()


@dataclass
class GroupSequence:
    """One rank's collectives on one process group."""

    count: int = 0
    digest: bytes = b""  # blake2b over the comparable tuples, in order
    first_call: str = ""  # "node <id> <name>" of the first call (for messages)
    # all_to_all calls with split sizes: (position, node id, in_splits, out_splits)
    splits: list[tuple[int, int, tuple, tuple]] = field(default_factory=list)


@dataclass
class RankSignature:
    """What pre-flight needs of one rank's trace."""

    rank: int
    source: str  # the file or archive member, for messages
    process_groups: list[ProcessGroupInfo]
    groups: dict[str, GroupSequence]  # resolved group name -> its sequence
    unnamed: bool  # some call's trace does not name its group (gloo), so group_map decides
    # point-to-point calls in order: (kind, peer global rank, dtype, elements, node id)
    p2p: list[tuple] = field(default_factory=list)

    @property
    def recorded_world_size(self) -> int | None:
        """The world this rank was recorded in (group "0"'s size), None if not recorded."""
        return next((g.group_size for g in self.process_groups if g.name == "0"), None)


def sequences(trace: Trace, group_map: dict | None) -> dict[str, list[Op]]:
    """Per resolved group name, the collective calls of the group's sequence, in order."""
    out: dict[str, list[Op]] = {}
    for op in trace.collectives:
        if op.collective.kind not in NOT_IN_SEQUENCE:
            out.setdefault(resolve_pg_name(op.collective, group_map), []).append(op)
    return out


def reduce_trace(trace: Trace, rank: int, group_map: dict | None) -> RankSignature:
    """The signature of a loaded trace."""
    groups = {}
    for name, ops in sequences(trace, group_map).items():
        seq = GroupSequence(first_call=f"node {ops[0].node_id} {ops[0].name}")
        digest = hashlib.blake2b(digest_size=16)
        for pos, op in enumerate(ops):
            c = op.collective
            digest.update(orjson.dumps(comparable(c)))
            if c.kind in _ALL_TO_ALL and c.in_splits:
                seq.splits.append((pos, op.node_id, c.in_splits, c.out_splits))
        seq.count, seq.digest = len(ops), digest.digest()
        groups[name] = seq
    unnamed = any(op.collective.pg_name is None and op.collective.kind != "wait"
                  for op in trace.collectives)
    return RankSignature(rank, trace.path, list(trace.process_groups), groups, unnamed,
                         _p2p(trace, group_map))


def _p2p(trace: Trace, group_map: dict | None) -> list[tuple]:
    """The rank's sends and receives in order, their peers as global ranks (a call records
    its peer's rank in the call's group)."""
    members = {g.name: sorted(g.ranks) for g in trace.process_groups if g.ranks}
    out = []
    for op in trace.collectives:
        c = op.collective
        if c.kind in ("send", "recv"):
            ranks = members.get(resolve_pg_name(c, group_map))
            peer = c.root if ranks is None or c.root is None or c.root >= len(ranks) \
                else ranks[c.root]
            out.append((c.kind, peer, c.dtype, c.in_nelems or c.out_nelems, op.node_id))
    return out


def rank_signature(source: TraceSource, rank: int, group_map: dict | None) -> RankSignature:
    """Load one rank's trace, reduce it, drop it (runs in a Ray task or a worker process)."""
    return reduce_trace(_load(source, rank), rank, group_map)


def group_calls(source: TraceSource, rank: int, group_map: dict | None,
                name: str) -> list[tuple[str, tuple, tuple]]:
    """``(call, signature, comparable)`` of every call on group ``name``, for messages."""
    ops = sequences(_load(source, rank), group_map).get(name, [])
    return [(f"node {op.node_id} {op.name}", op.collective.signature(), comparable(op.collective))
            for op in ops]


def _load(source: TraceSource, rank: int) -> Trace:
    try:
        return load_trace(source, rank=rank)
    except TraceError:
        raise
    except Exception as e:  # a loader bug or an OS error: still name the file
        raise TraceError(source, f"cannot load trace: {type(e).__name__}: {e}") from e
