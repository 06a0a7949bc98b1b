"""Pre-flight checks on a folder of rank traces, before any actor starts (no torch.distributed).

1. ``discover_rank_files``: ``rank-<r>.et.json[.gz]`` or PARAM's ``rank-<r>.json[.gz]``,
   ranks 0..N-1 without gaps or duplicates.
2. ``preflight``: loads every file (a process pool for several files), checks the world
   size (process-group tables, number of files, the requested size), merges the group
   tables, and checks per process group that the member ranks issue the same collective
   sequence, position by position (``Collective.signature()``; waits and point-to-point
   send/recv are not part of a group's sequence).

Asymmetric kinds are compared on what must agree: all_to_all(_single) with split sizes on
kind and dtype, plus a cross-check that rank i sends rank j what j expects from i; gather
on the input and scatter on the output size (only the root holds the list side).

gloo traces do not name the group of a ``c10d::*`` collective (``pg_name`` None). Such
collectives run on the default group "0" unless ``group_map`` says otherwise:
``{"*": name}`` for all of them, ``{"<kind>": name}`` per normalized kind (a kind entry wins
over "*"). When the tables hold groups of different memberships and no ``group_map`` is
given, preflight refuses: the mapping cannot be guessed.
"""
from __future__ import annotations

import multiprocessing
import os
import re
from concurrent.futures import ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

from actors.errors import ConfigError, TraceError
from actors.replay.process_groups import (DEFAULT_PG, group_members, merge_group_tables,
                                          resolve_pg_name)
from actors.trace import Op, ProcessGroupInfo, Trace, load_trace
from actors.trace.collectives import KINDS

_RANK_FILE = re.compile(r"^rank-(\d+)(?:\.et)?\.json(?:\.gz)?$")
_NOT_IN_SEQUENCE = frozenset({"wait", "send", "recv"})
_IN_PROCESS_BYTES = 8 << 20  # total file bytes loaded without worker processes
_MAX_WORKERS = 8


@dataclass
class PreflightResult:
    """What the driver needs to launch: the world, the files, the loaded traces, the groups."""

    world_size: int
    rank_files: dict[int, Path]
    traces: list[Trace]  # traces[r] is rank r's
    process_groups: list[ProcessGroupInfo]  # merged, in creation order
    group_map: dict[str, str] | None = None
    num_collectives: dict[str, int] = field(default_factory=dict)  # per group, per rank


def discover_rank_files(trace_dir) -> dict[int, Path]:
    """``{rank: path}`` for ranks 0..N-1; ConfigError if missing, empty, gapped or duplicated."""
    folder = Path(trace_dir)
    if not folder.is_dir():
        raise ConfigError(f"trace directory {folder} does not exist or is not a directory")
    found: dict[int, Path] = {}
    for path in sorted(folder.iterdir()):
        m = _RANK_FILE.match(path.name)
        if m is None or not path.is_file():
            continue
        rank = int(m.group(1))
        if rank in found:
            raise ConfigError(f"{folder}: rank {rank} has two trace files, {found[rank].name} "
                              f"and {path.name}; keep one")
        found[rank] = path
    if not found:
        raise ConfigError(f"{folder}: no rank trace files; expected rank-<r>.et.json[.gz] or "
                          "rank-<r>.json[.gz] for r = 0..N-1")
    missing = sorted(set(range(max(found) + 1)) - set(found))
    if missing:
        raise ConfigError(f"{folder}: missing trace files for rank(s) {missing} (found ranks "
                          f"{sorted(found)}); ranks must be 0..N-1 without gaps")
    return dict(sorted(found.items()))


def _load(path: Path, rank: int) -> Trace:
    try:
        return load_trace(path, rank=rank)
    except TraceError:
        raise
    except Exception as e:  # a loader bug or an OS error: still name the file
        raise TraceError(path, f"cannot load trace: {type(e).__name__}: {e}") from e


def load_rank_traces(rank_files: dict[int, Path], num_workers: int | None = None,
                     timeout_s: float = 3600.0) -> list[Trace]:
    """Load every rank's trace, in parallel processes when there are several files.

    ``timeout_s`` bounds the whole load (TraceError naming the files still loading).
    """
    if num_workers is None:
        # Small folders load faster here than a spawned worker takes to import torch.
        small = sum(path.stat().st_size for path in rank_files.values()) < _IN_PROCESS_BYTES
        num_workers = 1 if small else min(len(rank_files), os.cpu_count() or 1, _MAX_WORKERS)
    if num_workers <= 1 or len(rank_files) == 1:
        return [_load(path, rank) for rank, path in rank_files.items()]
    # spawn, not fork: the driver may already hold Ray's threads
    pool = ProcessPoolExecutor(num_workers, mp_context=multiprocessing.get_context("spawn"))
    futures = {rank: pool.submit(_load, path, rank) for rank, path in rank_files.items()}
    try:
        done, late = wait(futures.values(), timeout=timeout_s)
        if late:
            names = [rank_files[r].name for r, f in futures.items() if f in late]
            raise TraceError(names[0], f"loading {len(names)} trace file(s) ({', '.join(names)}) "
                                       f"took longer than {timeout_s:g} s")
        return [fut.result() for fut in futures.values()]  # re-raises a worker's TraceError
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


def _world_size(folder, rank_files, traces, requested: int | None) -> int:
    world = len(rank_files)
    for rank, trace in enumerate(traces):
        default = next((g for g in trace.process_groups if g.name == DEFAULT_PG), None)
        if default is not None and default.group_size != world:
            raise ConfigError(f"rank {rank}'s trace ({rank_files[rank].name}) was recorded with "
                              f"world size {default.group_size} (process group '0'), but {folder} "
                              f"holds {world} rank file(s)")
    if requested is not None and requested != world:
        if requested < world:
            raise ConfigError(f"the trace in {folder} has {world} ranks; a run on {requested} "
                              f"ranks cannot replay it (every rank replays its own file): set the "
                              f"world size to {world}")
        raise ConfigError(f"a run on {requested} ranks was requested but {folder} holds traces "
                          f"for {world} ranks only: set the world size to {world}")
    return world


def _check_group_map(group_map, members, traces) -> None:
    if group_map:
        for key, name in group_map.items():
            if key != "*" and key not in KINDS:
                raise ConfigError(f"group_map key {key!r} is neither '*' nor a collective kind "
                                  f"({', '.join(KINDS)})")
            if name not in members:
                raise ConfigError(f"group_map[{key!r}] = {name!r} is not a process group of the "
                                  f"trace (groups: {sorted(members)})")
        return
    world = members[DEFAULT_PG]
    odd = {name: m for name, m in members.items() if m != world}
    if not odd:
        return
    unnamed = [r for r, t in enumerate(traces) if any(
        op.collective.pg_name is None and op.collective.kind != "wait" for op in t.collectives)]
    if unnamed:
        groups = ", ".join(f"{name!r}: ranks {list(m)}" for name, m in sorted(odd.items()))
        raise ConfigError(
            f"rank(s) {unnamed} have collectives whose trace does not name their process group "
            f"(gloo traces), and the process-group tables hold groups that are not world-sized "
            f"({groups}): the group of each call cannot be inferred. Pass group_map, e.g. "
            f"{{'*': '0'}} to run them all on the default group, or per kind, e.g. "
            f"{{'all_gather_into_tensor': '1', '*': '0'}}")


def _sequences(traces, members, group_map) -> dict[str, dict[int, list[Op]]]:
    seqs: dict[str, dict[int, list[Op]]] = {name: {r: [] for r in m} for name, m in members.items()}
    for rank, trace in enumerate(traces):
        for op in trace.collectives:
            c = op.collective
            if c.kind in _NOT_IN_SEQUENCE:
                continue
            name = resolve_pg_name(c, group_map)
            if name not in members:
                raise ConfigError(f"rank {rank}, node {op.node_id} ({op.name}): process group "
                                  f"{name!r} is not in any rank's process-group table (known: "
                                  f"{sorted(members)})")
            if rank not in members[name]:
                raise ConfigError(f"rank {rank}, node {op.node_id} ({op.name}) runs on process "
                                  f"group {name!r} whose ranks {list(members[name])} exclude it")
            seqs[name][rank].append(op)
    return seqs


def _comparable(c) -> tuple:
    if c.kind in ("all_to_all", "all_to_all_single") and (c.in_splits or c.out_splits):
        return (c.kind, c.dtype)
    if c.kind == "gather":
        return (c.kind, c.dtype, c.in_nelems)
    if c.kind == "scatter":  # non-root ranks have no input list to take a dtype from
        return (c.kind, c.out_nelems)
    return c.signature()


def _describe(rank: int, op: Op) -> str:
    return f"rank {rank} (node {op.node_id} {op.name}: {op.collective.signature()})"


def _check_sequences(name: str, by_rank: dict[int, list[Op]]) -> None:
    ranks = sorted(by_rank)
    ref = ranks[0]
    for other in ranks[1:]:
        a, b = by_rank[ref], by_rank[other]
        for pos, (oa, ob) in enumerate(zip(a, b)):
            if _comparable(oa.collective) != _comparable(ob.collective):
                raise ConfigError(f"process group {name!r}: collective #{pos} differs between "
                                  f"{_describe(ref, oa)} and {_describe(other, ob)}")
        if len(a) != len(b):
            longer, op = (ref, a[len(b)]) if len(a) > len(b) else (other, b[len(a)])
            raise ConfigError(f"process group {name!r}: rank {ref} has {len(a)} collectives, rank "
                              f"{other} has {len(b)}; first unmatched is #{min(len(a), len(b))} "
                              f"on {_describe(longer, op)}")
    _check_splits(name, ranks, by_rank)


def _check_splits(name: str, ranks: list[int], by_rank: dict[int, list[Op]]) -> None:
    """all_to_all with splits: what group rank i sends to j is what j receives from i."""
    n = len(ranks)
    for pos, ops in enumerate(zip(*(by_rank[r] for r in ranks))):
        cs = [op.collective for op in ops]
        if cs[0].kind not in ("all_to_all", "all_to_all_single") or not cs[0].in_splits:
            continue
        for i, c in enumerate(cs):
            if len(c.in_splits) != n or len(c.out_splits) != n:
                raise ConfigError(f"process group {name!r}: collective #{pos} on "
                                  f"{_describe(ranks[i], ops[i])} has split sizes "
                                  f"{list(c.in_splits)}/{list(c.out_splits)} for {n} ranks")
        for i in range(n):
            for j in range(n):
                if cs[i].in_splits[j] != cs[j].out_splits[i]:
                    raise ConfigError(
                        f"process group {name!r}: collective #{pos}: rank {ranks[i]} sends "
                        f"{cs[i].in_splits[j]} to rank {ranks[j]} (node {ops[i].node_id}), which "
                        f"expects {cs[j].out_splits[i]} (node {ops[j].node_id})")


def preflight(trace_dir, world_size_requested: int | None = None,
              group_map: dict[str, str] | None = None,
              num_workers: int | None = None, load_timeout_s: float = 3600.0) -> PreflightResult:
    """Discover, load and cross-check a folder of rank traces (see the module doc).

    Raises ConfigError (layout, world size, groups, sequences) or TraceError (unreadable file).
    """
    rank_files = discover_rank_files(trace_dir)
    traces = load_rank_traces(rank_files, num_workers, load_timeout_s)
    world = _world_size(trace_dir, rank_files, traces, world_size_requested)
    table = merge_group_tables([t.process_groups for t in traces], world)
    members = group_members(table, world)
    _check_group_map(group_map, members, traces)
    seqs = _sequences(traces, members, group_map)
    for name, by_rank in seqs.items():
        _check_sequences(name, by_rank)
    counts = {name: len(next(iter(by_rank.values()))) for name, by_rank in seqs.items() if by_rank}
    return PreflightResult(world, rank_files, traces, table, group_map, counts)
