"""Extensions join the op loop at planned points without the loop branching on them.

An extension (ZeRO-3 fetch/release, host-gap reproduction) plans once, after the engine has
compiled its steps, which callables run right before or right after which ops; the engine
turns each into a step of kind ``hook`` in its step list, so the loop calls it like any
other step. Storages an extension owns (ZeRO-3's partitioned parameters) are left alone by
the allocation policy: never allocated, pinned, freed or flushed by it.

Engine facilities an extension may use (all set when ``attach`` is called):

* ``engine.trace``, ``engine.liveness``, ``engine.device``, ``engine.rank``, ``engine.cfg``;
* ``engine.store.bind(t, x)``: make tensor ``x`` the value of ``TensorArg t`` without
  accounting; ``engine.store.unbind(suid)``: drop every tensor on storage ``suid``;
* ``engine.memory.charge(nbytes, category)`` / ``engine.memory.discharge(nbytes, category)``
  (a category of actors/trace/categories.py): account bytes the
  extension allocates itself (they count toward the peak, the capacity and the threshold);
* ``engine.comm``: the CollectiveReplayer (None in compute mode), whose ``groups`` hold the
  rebuilt process groups (``groups.handle("0")`` is the world group).
"""
from __future__ import annotations

from typing import Callable

Hook = Callable[[], None]


class ReplayExtension:
    """Base class: every method has a do-nothing default."""

    #: key of this extension's figures in the rank report
    name = "extension"

    def attach(self, engine) -> None:
        """Plan against the compiled engine (called once, before the first iteration)."""

    def allocate(self) -> None:
        """Allocate what the extension holds for the whole replay (ZeRO-3's shards). Called
        once by the engine before the first iteration, inside the memory meter's window, so
        the measured peak includes it."""

    def resident_bytes(self) -> int:
        """Bytes the extension holds from ``allocate`` to the end of the replay, whatever the
        op (ZeRO-3's shards): they count in the replay's liveness lower bound."""
        return 0

    def owned_storages(self) -> set[int]:
        """Storage generations (suids) this extension manages instead of the allocation policy."""
        return set()

    def hooks(self) -> tuple[dict[int, list[Hook]], dict[int, list[Hook]]]:
        """``(before, after)``: op index -> callables run right before / right after that op."""
        return {}, {}

    def on_iteration_start(self) -> None:
        """Called before the first op of every iteration."""

    def on_iteration_end(self, measured: bool) -> None:
        """Called after the last op of every iteration (``measured``: a timed iteration)."""

    def report(self) -> dict:
        """Figures for the rank report, under ``name``."""
        return {}

    def headline(self) -> dict:
        """Figures for the top level of the rank report (the driver aggregates them)."""
        return {}
