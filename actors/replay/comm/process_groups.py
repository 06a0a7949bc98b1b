"""Process groups: merge the ranks' ``## process_group:init ##`` tables, rebuild the groups.

Each rank's table lists only the groups that rank belongs to. ``merge_group_tables`` turns
the per-rank tables into one global, ordered list (pure Python, used by the driver's
pre-flight). ``ProcessGroups`` (rank side) creates every group with
``torch.distributed.new_group`` in that same order on every rank, as torch requires, and
maps a collective's ``pg_name`` to its group handle.

Group "0" is the default group (WORLD). Collectives whose trace cannot name their group
(gloo traces: ``pg_name`` None) go through ``group_map``: ``{"<kind>": name, "*": name}``
(a kind entry wins over ``"*"``; without either they go to "0").
"""
from __future__ import annotations

from datetime import timedelta

from actors.errors import ConfigError, ReplayError
from actors.trace.model import Collective, ProcessGroupInfo

DEFAULT_PG = "0"


def _order_key(name: str, first_seen: int) -> tuple:
    # torch names groups "0", "1", ... in creation order; other names keep first-seen order.
    return (0, int(name), 0) if name.isdigit() else (1, 0, first_seen)


def _members(info: ProcessGroupInfo, world_size: int) -> tuple[int, ...]:
    # new_group sorts its ranks, so group rank i is the i-th smallest global rank.
    return tuple(sorted(info.ranks)) if info.ranks else tuple(range(world_size))


def merge_group_tables(tables: list[list[ProcessGroupInfo]],
                       world_size: int) -> list[ProcessGroupInfo]:
    """Merge per-rank group tables (``tables[r]`` is rank r's) into one global ordered list.

    Raises ConfigError when two ranks describe the same group name differently, when a
    rank lists a group it is not a member of, or when a group's ranks do not fit the world.
    """
    merged: dict[str, ProcessGroupInfo] = {}
    seen_by: dict[str, int] = {}  # name -> first rank that listed it
    first_seen: dict[str, int] = {}
    for rank, table in enumerate(tables):
        for info in table:
            members = _members(info, world_size)
            if not info.ranks and info.group_size != world_size:
                raise ConfigError(
                    f"rank {rank}: process group {info.name!r} lists all ranks but has "
                    f"group_size {info.group_size}, world size is {world_size}")
            if info.ranks and (len(info.ranks) != info.group_size
                               or any(not 0 <= r < world_size for r in info.ranks)):
                raise ConfigError(
                    f"rank {rank}: process group {info.name!r} has ranks {list(info.ranks)} "
                    f"and group_size {info.group_size}, world size {world_size}")
            if rank not in members:
                raise ConfigError(
                    f"rank {rank} lists process group {info.name!r} whose ranks "
                    f"{list(members)} do not include it")
            other = merged.get(info.name)
            if other is None:
                merged[info.name] = info
                seen_by[info.name] = rank
                first_seen[info.name] = len(first_seen)
                continue
            if (other.desc, _members(other, world_size), other.group_size) != \
                    (info.desc, members, info.group_size):
                raise ConfigError(
                    f"process group {info.name!r} differs between rank {seen_by[info.name]} "
                    f"(desc {other.desc!r}, ranks {list(_members(other, world_size))}, size "
                    f"{other.group_size}) and rank {rank} (desc {info.desc!r}, ranks "
                    f"{list(members)}, size {info.group_size})")
    return sorted(merged.values(), key=lambda i: _order_key(i.name, first_seen[i.name]))


def resolve_pg_name(collective: Collective, group_map: dict[str, str] | None) -> str:
    """The group name a collective runs on: its own, else ``group_map`` (kind, then "*")."""
    if collective.pg_name is not None:
        return collective.pg_name
    if group_map:
        return group_map.get(collective.kind, group_map.get("*", DEFAULT_PG))
    return DEFAULT_PG


def group_members(table: list[ProcessGroupInfo], world_size: int) -> dict[str, tuple[int, ...]]:
    """``{pg_name: global member ranks}`` for a merged table; "0" is always the world."""
    out = {info.name: _members(info, world_size) for info in table}
    out[DEFAULT_PG] = tuple(range(world_size))
    return out


class ProcessGroups:
    """The rank's live process groups, keyed by trace ``pg_name``."""

    def __init__(self, rank: int, world_size: int, handles: dict, members: dict,
                 group_map: dict[str, str] | None = None, timeout_s: float | None = None):
        self.rank = rank
        self.timeout_s = timeout_s  # every group's bound on a collective (None: unknown)
        self.world_size = world_size
        self._handles = handles  # name -> ProcessGroup, only groups this rank is in
        self._members = members  # name -> sorted global ranks
        self.group_map = dict(group_map or {})

    @classmethod
    def create(cls, global_table: list[ProcessGroupInfo], rank: int, world_size: int,
               backend: str, timeout_s: float,
               group_map: dict[str, str] | None = None) -> "ProcessGroups":
        """Create every non-default group of ``global_table`` in order (collective call).

        The default process group must already be initialized (its own timeout bounds
        collectives on "0"); ``timeout_s`` bounds every collective on the new groups:
        gloo raises after it, NCCL's watchdog aborts the communicator.
        """
        import torch.distributed as dist  # rank side only; the driver merges tables torch-free

        if not dist.is_initialized() or dist.get_world_size() != world_size:
            raise ReplayError(f"rank {rank}: the default process group must be initialized "
                              f"with world size {world_size} before creating groups")
        members = group_members(global_table, world_size)
        handles = {DEFAULT_PG: dist.group.WORLD}
        timeout = timedelta(seconds=timeout_s)
        for info in global_table:
            if info.name == DEFAULT_PG:
                continue
            pg = dist.new_group(list(members[info.name]), timeout=timeout, backend=backend,
                                group_desc=info.desc or None)
            if rank in members[info.name]:
                handles[info.name] = pg
        return cls(rank, world_size, handles, members, group_map, timeout_s)

    def name_of(self, collective: Collective) -> str:
        """The pg_name ``collective`` runs on (group_map applied when the trace has none)."""
        return resolve_pg_name(collective, self.group_map)

    def resolve(self, collective: Collective, op=None):
        """The ProcessGroup handle for ``collective``; ReplayError naming ``op`` if unusable."""
        name = self.name_of(collective)
        handle = self._handles.get(name)
        if handle is None:
            where = f"node {op.node_id} ({op.name}): " if op is not None else ""
            if name not in self._members:
                raise ReplayError(f"{where}rank {self.rank}: unknown process group {name!r} "
                                  f"(known: {sorted(self._members)})")
            raise ReplayError(f"{where}rank {self.rank} is not a member of process group "
                              f"{name!r} (ranks {list(self._members[name])})")
        return handle

    def handle(self, name: str):
        """The ProcessGroup handle of group ``name`` (ReplayError if this rank is not in it)."""
        if name not in self._handles:
            raise ReplayError(f"rank {self.rank} holds no process group {name!r} "
                              f"(its groups: {sorted(self._handles)})")
        return self._handles[name]

    def members(self, name: str) -> tuple[int, ...]:
        """Global ranks of group ``name``, in group-rank order."""
        return self._members[name]

    def global_rank(self, name: str, group_rank: int) -> int:
        """Global rank of ``group_rank`` within group ``name``."""
        members = self._members[name]
        if not 0 <= group_rank < len(members):
            raise ReplayError(f"group rank {group_rank} out of range for process group "
                              f"{name!r} of size {len(members)}")
        return members[group_rank]
