"""Allocation policies: one small class per ``replay.allocation.mode``.

Each says, for one rank's trace, which storages are *persistent* (materialized before the
first iteration and kept across iterations, never flushed), which storages are freed right
after each op, and therefore what a threshold flush drops (every held storage that is not
persistent; later uses re-materialize it with synthetic data, as the reference replayer does).
The op loop calls the policy's per-op free lists and never branches on the mode.

============  ==========================  ============================  =====================
mode          persistent                  freed after an op             a flush drops
============  ==========================  ============================  =====================
pre_allocate  storages made outside the   nothing (intermediates live   (flushing refused:
              trace (first seen as an     to the end of the iteration)  nothing is freeable)
              input): params, optimizer
              state, inputs
lazy          nothing (params re-created  every storage at its last     everything held
              every iteration)            use
faithful      as pre_allocate, less what  every non-persistent storage  every non-persistent
              the iteration made inside   at its last use               storage
              an op
============  ==========================  ============================  =====================

"Made outside the trace" is what the trace shows alive when the iteration starts: a storage
whose first use is as an input existed before the first op (parameters, gradients kept
across steps, optimizer state, framework buffers, the batch). ``faithful`` leaves out the
storages an op nested inside another made during the iteration (a composite op's saved
intermediates, such as ``cross_entropy_loss``'s ``log_softmax``; actors/trace/made_inside.py):
the original allocated and freed them in the iteration, so they are freed at their last use
and re-made at their first; ``pre_allocate`` keeps the reference replayer's rule.
"""
from __future__ import annotations

from actors.replay.config import AllocationMode
from actors.trace.liveness import Liveness


class AllocationPolicy:
    """Base: subclasses set ``keeps_persistent`` and ``frees_at_last_use``."""

    mode: AllocationMode
    keeps_persistent: bool
    frees_at_last_use: bool
    keeps_made_inside: bool = True  # whether storages made inside the iteration can persist

    def __init__(self, liveness: Liveness, used_storages: set[int], owned: set[int],
                 made_inside: frozenset[int] = frozenset(),
                 released: frozenset[int] = frozenset()):
        """``used_storages``: suids the replayed ops read or write (steps in scope);
        ``owned``: suids an extension manages (never allocated, pinned or freed here);
        ``made_inside``: suids first used as inputs that the iteration made (Trace.made_inside);
        ``released``: suids the run was seen freeing during the iteration (recorded frees:
        actors/trace/recorded_frees.py), which the faithful mode does not keep either."""
        external = liveness.storage_external
        skip_made = frozenset() if self.keeps_made_inside else made_inside | released
        self.persistent: frozenset[int] = frozenset(
            s for s in used_storages if external[s] and s not in owned and s not in skip_made) \
            if self.keeps_persistent else frozenset()
        skip = self.persistent | owned
        self.free_lists: list[tuple[int, ...]] = [
            tuple(s for s in suids if s not in skip) if self.frees_at_last_use else ()
            for suids in liveness.free_after]

    def persistent_bytes(self, storage_bytes: list[int]) -> int:
        """Accounted bytes of the persistent set."""
        return sum(storage_bytes[s] for s in self.persistent)


class PreAllocate(AllocationPolicy):
    """The reference replayer: inputs allocated up front, intermediates held to the end."""

    mode = AllocationMode.pre_allocate
    keeps_persistent = True
    frees_at_last_use = False


class Lazy(AllocationPolicy):
    """Every storage lives from its first to its last use, parameters included."""

    mode = AllocationMode.lazy
    keeps_persistent = False
    frees_at_last_use = True


class Faithful(AllocationPolicy):
    """What the original run did: what existed before the iteration stays, the rest is freed
    right after its last use."""

    mode = AllocationMode.faithful
    keeps_persistent = True
    frees_at_last_use = True
    keeps_made_inside = False


_POLICIES = {cls.mode: cls for cls in (PreAllocate, Lazy, Faithful)}


def make_policy(mode: AllocationMode, liveness: Liveness, used_storages: set[int],
                owned: set[int], made_inside: frozenset[int] = frozenset(),
                released: frozenset[int] = frozenset()) -> AllocationPolicy:
    """The policy of ``replay.allocation.mode``."""
    return _POLICIES[AllocationMode(mode)](liveness, used_storages, owned, made_inside,
                                           released)
