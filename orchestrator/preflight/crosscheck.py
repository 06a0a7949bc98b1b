"""Cross-rank checks of the collective signatures: groups, group_map, sequences, splits.

Per process group, the member ranks must issue the same collective sequence, position by
position (`orchestrator.preflight.signature.comparable`); all_to_all with split sizes is also
cross-checked: what group rank i sends to j is what j expects from i.

gloo traces do not name the group of a ``c10d::*`` collective (``pg_name`` None). Such
collectives run on the default group "0" unless ``group_map`` says otherwise:
``{"*": name}`` for all of them, ``{"<kind>": name}`` per normalized kind (a kind entry wins
over "*"). When the tables hold groups of different memberships and no ``group_map`` is
given, the check refuses: the mapping cannot be guessed.

Sends and receives (pipeline parallel) are not a group's sequence: each rank's sends to a
peer, in order, must be that peer's receives from it, in order, one for one in size and dtype
(`check_point_to_point`).

Every check raises ConfigError naming the ranks, the group and the position.
"""
from __future__ import annotations

from actors.errors import ConfigError
from actors.replay.comm.process_groups import DEFAULT_PG, group_members, merge_group_tables
from actors.trace import ProcessGroupInfo
from actors.trace.collectives import KINDS
from actors.trace.source import TraceSource
from orchestrator.preflight.signature import RankSignature, group_calls


def cross_check(sigs: dict[int, RankSignature], sources: dict[int, TraceSource], world_size: int,
                group_map: dict | None) -> tuple[list[ProcessGroupInfo], dict[str, int]]:
    """Check the signatures of the ranks in ``sigs`` (a subset of the world, or all of it).

    Returns the merged process-group table and the number of collectives per group.
    """
    table = merge_group_tables([sigs[r].process_groups if r in sigs else []
                                for r in range(world_size)], world_size)
    full = group_members(table, world_size)
    # a subset replay (compute mode) compares the member ranks it has
    present = {name: tuple(r for r in m if r in sigs) for name, m in full.items()}
    _check_group_map(group_map, full, sigs)
    _check_membership(sigs, full)
    check_point_to_point(sigs)
    counts = {}
    for name, ranks in present.items():
        if not ranks:
            continue
        _check_sequence(name, ranks, sigs, sources, group_map)
        if ranks == full[name]:  # split sizes index every member of the group
            _check_splits(name, ranks, sigs)
        counts[name] = _key(sigs[ranks[0]], name)[0]
    return table, counts


def _check_group_map(group_map, members, sigs) -> None:
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
    unnamed = [r for r, sig in sigs.items() if sig.unnamed]
    if odd and unnamed:
        groups = ", ".join(f"{name!r}: ranks {list(m)}" for name, m in sorted(odd.items()))
        raise ConfigError(
            f"rank(s) {unnamed} have collectives whose trace does not name their process group "
            f"(gloo traces), and the process-group tables hold groups that are not world-sized "
            f"({groups}): the group of each call cannot be inferred. Pass group_map, e.g. "
            f"{{'*': '0'}} to run them all on the default group, or per kind, e.g. "
            f"{{'all_gather_into_tensor': '1', '*': '0'}}")


def _check_membership(sigs, members) -> None:
    for rank, sig in sigs.items():
        for name, seq in sig.groups.items():
            if name not in members:
                raise ConfigError(f"rank {rank}, {seq.first_call} ({sig.source}): process group "
                                  f"{name!r} is not in any rank's process-group table (known: "
                                  f"{sorted(members)})")
            if rank not in members[name]:
                raise ConfigError(f"rank {rank}, {seq.first_call} runs on process group {name!r} "
                                  f"whose ranks {list(members[name])} exclude it")


def _key(sig: RankSignature, name: str) -> tuple:
    seq = sig.groups.get(name)
    return (seq.count, seq.digest) if seq is not None else (0, b"")


def _check_sequence(name, ranks, sigs, sources, group_map) -> None:
    ref = ranks[0]
    other = next((r for r in ranks[1:] if _key(sigs[r], name) != _key(sigs[ref], name)), None)
    if other is None:
        return
    # only now load the two disagreeing ranks again, to name the first differing call
    a, b = (group_calls(sources[r], r, group_map, name) for r in (ref, other))
    for pos, (ca, cb) in enumerate(zip(a, b)):
        if ca[2] != cb[2]:
            raise ConfigError(f"process group {name!r}: collective #{pos} differs between "
                              f"rank {ref} ({ca[0]}: {ca[1]}) and rank {other} ({cb[0]}: {cb[1]})")
    longer, call = (ref, a[len(b)]) if len(a) > len(b) else (other, b[len(a)])
    raise ConfigError(f"process group {name!r}: rank {ref} has {len(a)} collectives, rank "
                      f"{other} has {len(b)}; first unmatched is #{min(len(a), len(b))} on rank "
                      f"{longer} ({call[0]}: {call[1]})")


def _check_splits(name, ranks, sigs) -> None:
    """all_to_all with splits: what group rank i sends to j is what j receives from i."""
    per_rank = [sigs[r].groups[name].splits if name in sigs[r].groups else [] for r in ranks]
    n = len(ranks)
    for calls in zip(*per_rank):  # same positions on every rank: the sequences agree
        pos = calls[0][0]
        for rank, (_, node, ins, outs) in zip(ranks, calls):
            if len(ins) != n or len(outs) != n:
                raise ConfigError(f"process group {name!r}: collective #{pos} on rank {rank} "
                                  f"(node {node}) has split sizes {list(ins)}/{list(outs)} for "
                                  f"{n} ranks")
        for i in range(n):
            for j in range(n):
                if calls[i][2][j] != calls[j][3][i]:
                    raise ConfigError(
                        f"process group {name!r}: collective #{pos}: rank {ranks[i]} sends "
                        f"{calls[i][2][j]} to rank {ranks[j]} (node {calls[i][1]}), which "
                        f"expects {calls[j][3][i]} (node {calls[j][1]})")


def check_point_to_point(sigs: dict[int, RankSignature]) -> None:
    """Pair every send with its receive (ranks of ``sigs`` only); ConfigError naming the first
    one without its match."""
    sends: dict[tuple[int, int], list] = {}
    recvs: dict[tuple[int, int], list] = {}
    for rank, sig in sigs.items():
        for kind, peer, dtype, nelems, node in sig.p2p:
            if kind == "send":
                sends.setdefault((rank, peer), []).append((dtype, nelems, node))
            else:
                recvs.setdefault((peer, rank), []).append((dtype, nelems, node))
    for src, dst in sorted(set(sends) | set(recvs)):
        if src not in sigs or dst not in sigs:
            continue  # a subset replay: the peer's trace is not here
        out, got = sends.get((src, dst), []), recvs.get((src, dst), [])
        for i, (s, r) in enumerate(zip(out, got)):
            if s[:2] != r[:2]:
                raise ConfigError(f"send #{i} from rank {src} to rank {dst} (node {s[2]}: "
                                  f"{s[1]} {s[0]}) does not match rank {dst}'s receive #{i} "
                                  f"from rank {src} (node {r[2]}: {r[1]} {r[0]})")
        if len(out) != len(got):
            if len(out) > len(got):
                s = out[len(got)]
                raise ConfigError(f"send #{len(got)} from rank {src} to rank {dst} (node "
                                  f"{s[2]}: {s[1]} {s[0]}) has no receive on rank {dst}, "
                                  f"which receives {len(got)} from rank {src}")
            r = got[len(out)]
            raise ConfigError(f"receive #{len(out)} on rank {dst} from rank {src} (node "
                              f"{r[2]}: {r[1]} {r[0]}) has no send on rank {src}, which sends "
                              f"{len(out)} to rank {dst}")
