"""Pre-flight: check the rank traces before any actor starts (no torch.distributed).

1. Find the rank traces of ``trace.dir``: a folder, a ``.tar[.gz]`` archive or one file
   (`actors.trace.source.discover`; the rank-from-name rule is in `actors.trace.archive`),
   check the per-rank figures of a capture's ``meta.json`` beside them
   (`actors.trace.meta_file.check_ranks`), and select ``trace.ranks`` (default: all of them).
2. Group the selected ranks by trace content (`orchestrator.preflight.trace_identity`: hard links by
   inode, then size and hash) and reduce one trace per group to its collective signature
   where it is (`orchestrator.preflight.signature_pool`); the other ranks of a group share it. The
   driver never holds full traces. In compute mode the launch replays one actor per group
   (``same_as``).
3. Check the world: the recorded world size (process group "0") bounds the ranks; ``full``
   and ``comms`` replay collectives, so they need every rank of the recorded world;
   ``compute`` replays any subset (one file of a 2-GPU job, ``trace.ranks=[0,3]``).
4. Cross-check the collective sequences per process group (`orchestrator.preflight.crosscheck`).
   ``full``/``comms`` refuse a mismatch, naming ranks, group and position; ``compute``
   replays no collective, so a mismatch there is a warning (logged and returned, for
   ``summary.json``'s ``preflight_warnings``).

Actor i replays trace rank ``ranks[i]``; ``world_size`` is the number of actors.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from pathlib import Path

from actors.errors import ConfigError
from actors.trace import ProcessGroupInfo
from actors.trace.model import MAX_WORLD_SIZE
from actors.trace.archive import DEFAULT_MAX_DECOMPRESSED_BYTES, rank_from_name
from actors.trace.meta_file import check_ranks, meta_path_of, read_meta, recorded_world_size
from actors.trace.source import TraceSource, discover
from orchestrator.preflight.crosscheck import cross_check
from orchestrator.preflight.signature import RankSignature
from orchestrator.preflight.signature_pool import collect
from orchestrator.preflight.trace_identity import identical_groups, representatives

log = logging.getLogger("tracefleet")
_COLLECTIVE_MODES = ("full", "comms")


@dataclass
class PreflightResult:
    """What the driver needs to launch: the actors' traces, the recorded world, the groups."""

    world_size: int  # actors to start: one per selected rank
    ranks: list[int]  # ranks[i]: the trace rank actor i replays
    sources: list[TraceSource]  # sources[i]: where actor i's trace is
    recorded_world_size: int  # the world the traces were recorded in
    process_groups: list[ProcessGroupInfo]  # merged, in creation order
    group_map: dict[str, str] | None = None
    num_collectives: dict[str, int] = field(default_factory=dict)  # per group, per rank
    warnings: list[str] = field(default_factory=list)  # compute mode: mismatches not refused
    # same_as[i]: the lowest actor index whose trace is byte-identical to actor i's (i itself
    # for a group's representative); empty: not grouped (every actor its own).
    same_as: list[int] = field(default_factory=list)

    @property
    def num_distinct_traces(self) -> int:
        """How many different traces the actors replay (byte for byte)."""
        return len(set(self.same_as)) if self.same_as else self.world_size

    @property
    def rank_files(self) -> dict[int, Path]:
        """``{actor index: file on disk}`` (an archive for members; for file versions)."""
        return {i: Path(s.path) for i, s in enumerate(self.sources)}

    def to_dict(self) -> dict:
        """JSON-ready result (``preflight.json``; merged into ``summary.json``)."""
        return {"world_size": self.world_size, "recorded_world_size": self.recorded_world_size,
                "trace_ranks": self.ranks, "sources": [str(s) for s in self.sources],
                "process_groups": [{"name": g.name, "desc": g.desc, "ranks": list(g.ranks),
                                    "group_size": g.group_size} for g in self.process_groups],
                "num_collectives": self.num_collectives, "preflight_warnings": self.warnings,
                "num_distinct_traces": self.num_distinct_traces}


def preflight(trace_dir, world_size_requested: int | None = None,
              group_map: dict[str, str] | None = None, mode: str = "full",
              ranks: list[int] | None = None,
              max_decompressed_bytes: int = DEFAULT_MAX_DECOMPRESSED_BYTES,
              executor: str | None = None, num_workers: int | None = None,
              load_timeout_s: float = 3600.0,
              parsed_cache_dir: str | None = None) -> PreflightResult:
    """Discover, select, reduce and cross-check the rank traces of ``trace_dir`` (module doc).

    ``executor``/``num_workers``: see `orchestrator.preflight.signature_pool.collect` (None: automatic).
    ``parsed_cache_dir``: where the loaded traces are kept for the ranks' loads (`TraceSource`).
    Raises ConfigError (layout, world size, selection, groups, sequences) or TraceError
    (an unreadable trace).
    """
    found = discover(trace_dir, max_decompressed_bytes, parsed_cache_dir)
    meta_world = _check_meta(trace_dir)
    selected = _select(trace_dir, found, ranks)
    sources = {r: found[r] for r in selected}
    groups = identical_groups(sources)
    sigs = _signatures(sources, groups, group_map, executor, num_workers, load_timeout_s)
    world = _recorded_world(trace_dir, found, sigs, meta_world)
    _check_selection(_describe(trace_dir, found), world, selected, mode)
    _check_requested(trace_dir, len(selected), world_size_requested)
    warnings = []
    try:
        table, counts = cross_check(sigs, sources, world, group_map)
    except ConfigError as e:
        if mode in _COLLECTIVE_MODES:
            raise
        warnings.append(f"collectives: {e} (replay.mode={mode} replays no collective; "
                        "full and comms would refuse this)")
        log.warning("pre-flight: %s", warnings[-1])
        table, counts = [], {}
    rep = representatives(groups)
    index = {r: i for i, r in enumerate(selected)}
    return PreflightResult(len(selected), selected, [sources[r] for r in selected], world, table,
                           group_map, counts, warnings, [index[rep[r]] for r in selected])


def _check_meta(trace_dir) -> int | None:
    """The per-rank figures of the capture's ``meta.json`` beside the traces, when there is
    one (actors/trace/meta_file.py: TraceError naming the file and field); the world size it
    records."""
    if Path(trace_dir).is_dir():
        path = meta_path_of(trace_dir)
        meta = read_meta(path)
        if meta is not None:
            check_ranks(path, meta)
            return recorded_world_size(trace_dir)
    return None


def _signatures(sources: dict[int, TraceSource], groups: dict[int, list[int]], group_map,
                *collect_args) -> dict[int, RankSignature]:
    """Every rank's signature, one trace of each group of identical ones loaded and reduced
    (loading is what costs at 1,024 ranks); the others get a copy naming their rank and file."""
    reduced = collect({rep: sources[rep] for rep in groups}, group_map, *collect_args)
    return {rank: reduced[rep] if rank == rep else
            replace(reduced[rep], rank=rank, source=str(sources[rank]))
            for rep, ranks in groups.items() for rank in ranks}


def _select(where, found: dict[int, TraceSource], ranks) -> list[int]:
    if ranks is None:
        return sorted(found)
    wanted = sorted(set(int(r) for r in ranks))
    if not wanted:
        raise ConfigError("trace.ranks is empty; list the ranks to replay or leave it null (all)")
    absent = [r for r in wanted if r not in found]
    if absent:
        raise ConfigError(f"trace.ranks asks for rank(s) {absent}, but {where} holds traces of "
                          f"rank(s) {sorted(found)}")
    return wanted


def _recorded_world(where, found, sigs: dict[int, RankSignature],
                    meta_world: int | None = None) -> int:
    """The world size recorded in the traces (group "0"), else in the capture's meta.json,
    else the highest rank + 1."""
    recorded = {r: s.recorded_world_size for r, s in sigs.items() if s.recorded_world_size}
    sizes = sorted(set(recorded.values()))
    if not sizes and meta_world is not None:
        sizes = [meta_world]
    if len(sizes) > 1:
        by_size = {size: [r for r, s in recorded.items() if s == size] for size in sizes}
        raise ConfigError(f"{where}: the traces were recorded with different world sizes "
                          f"(process group '0'): " + ", ".join(
                              f"{size} on rank(s) {rs}" for size, rs in by_size.items()))
    world = sizes[0] if sizes else max(found) + 1
    if world > MAX_WORLD_SIZE:
        raise ConfigError(f"{where}: a world of {world:,} ranks (from the rank in a file name); "
                          f"expected at most {MAX_WORLD_SIZE:,}")
    beyond = [r for r in found if r >= world]
    if beyond:
        raise ConfigError(f"{where}: rank trace(s) {[str(found[r]) for r in beyond]} have rank(s) "
                          f"{beyond}, but the traces were recorded with world size {world} "
                          "(process group '0')")
    return world


def _describe(where, found: dict[int, TraceSource]) -> str:
    """``where``, plus how a lone trace got its rank when its name carries none."""
    (only,) = found.values() if len(found) == 1 else (None,)
    if only is not None and rank_from_name(only.name) is None:
        return f"{where} (one trace without a rank in its name: taken as rank 0)"
    return str(where)


def _check_selection(where, world: int, selected: list[int], mode: str) -> None:
    missing = sorted(set(range(world)) - set(selected))
    if missing and mode in _COLLECTIVE_MODES:
        raise ConfigError(
            f"replay.mode={mode} replays collectives, which need every member of each process "
            f"group: the traces were recorded with world size {world}, but {where} gives "
            f"rank(s) {selected} (missing trace files for rank(s) {missing}, or not in "
            "trace.ranks). replay.mode=compute replays a subset of the ranks")


def _check_requested(where, num_selected: int, requested: int | None) -> None:
    if requested is None or requested == num_selected:
        return
    if requested < num_selected:
        raise ConfigError(f"the trace in {where} has {num_selected} ranks to replay; a run on "
                          f"{requested} ranks cannot replay it (every rank replays its own file): "
                          f"set the world size to {num_selected}, or select ranks with trace.ranks")
    raise ConfigError(f"a run on {requested} ranks was requested but {where} holds traces for "
                      f"{num_selected} ranks only: set the world size to {num_selected}")
