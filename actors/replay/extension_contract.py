"""The one contract every part of a replay beyond the op loop joins it by: collectives, the
memory meter, ZeRO-3, host gaps, nested memory, the reserved-memory model, test probes.

An extension plans once, after the steps are compiled (``attach``), which callables run
right before or right after which ops (``hooks``) and which ops it replays itself (``runs``:
collectives); the compile step (actors/replay/program.py) turns each hook into a step of kind
``hook``, so the loop calls it like any other step and never branches on which extensions
are present. Storages an extension owns (ZeRO-3's partitioned parameters) are left alone by
the allocation policy: never allocated, pinned, freed or flushed by it.

What an extension may use of the replay is its ``ReplayContext``, nothing else.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:  # types only: the context is built by actors/replay/program.py
    import torch

    from actors.replay.comm.replayer import CollectiveReplayer
    from actors.replay.config import ReplayConfig
    from actors.replay.memory.accounting import MemoryTracker
    from actors.replay.memory.policies import AllocationPolicy
    from actors.replay.memory.tensor_store import TensorStore
    from actors.trace.liveness import Liveness
    from actors.trace.model import Trace

Hook = Callable[[], None]


@dataclass
class ReplayContext:
    """The engine facilities an extension may use; every field is set when ``attach`` is
    called, except ``policy`` (set after every extension attached, before ``hooks``)."""

    trace: Trace
    cfg: ReplayConfig
    device: torch.device
    rank: int
    liveness: Liveness  # storage sizes, first/last uses (actors/trace/liveness.py)
    #: ``charge(nbytes, category)`` / ``discharge(nbytes, category)`` account bytes the
    #: extension allocates itself (a category of actors/trace/categories.py): they count
    #: toward the peak, the capacity and the threshold; ``observe(x)`` reports every
    #: allocation and free to ``x`` (the reserved-memory model)
    memory: MemoryTracker
    #: ``bind(t, x)`` makes tensor ``x`` the value of ``TensorArg t`` without accounting;
    #: ``unbind(suid)`` drops every tensor on storage ``suid``; ``get(t)`` materializes
    store: TensorStore
    #: the CollectiveReplayer (None without process groups, e.g. compute mode); its
    #: ``groups.handle("0")`` is the world group, ``blocked_s`` the time spent in collectives
    comm: CollectiveReplayer | None
    #: every extension of the replay, in order (this one included)
    extensions: list = field(default_factory=list)
    #: the allocation policy (``frees_at_last_use``, ``persistent``): None during ``attach``
    policy: AllocationPolicy | None = None


class ReplayExtension:
    """Base class: every hook has a do-nothing default. The engine calls them in list order
    (actors/replay/extension_list.py builds the list)."""

    #: key of this extension's figures in the rank report
    name = "extension"

    # --- planning (once, by the compile step) ---------------------------------------------
    def attach(self, ctx: ReplayContext) -> None:
        """Plan against the compiled steps (called once, before the first iteration)."""

    def owned_storages(self) -> set[int]:
        """Storage generations (suids) this extension manages instead of the allocation policy."""
        return set()

    def hooks(self) -> tuple[dict[int, list[Hook]], dict[int, list[Hook]]]:
        """``(before, after)``: op index -> callables run right before / right after that op."""
        return {}, {}

    def runs(self) -> dict[int, Hook]:
        """Op index -> a callable that replays that op in the engine's place (collectives),
        called after the op's memory check."""
        return {}

    # --- the replay -----------------------------------------------------------------------
    def allocate(self) -> None:
        """Allocate what the extension holds for the whole replay (ZeRO-3's shards). Called
        once by the engine before the first iteration, inside the memory meter's window, so
        the measured peak includes it."""

    def resident_bytes(self) -> int:
        """Bytes the extension holds from ``allocate`` to the end of the replay, whatever the
        op (ZeRO-3's shards): they count in the replay's liveness lower bound."""
        return 0

    def world_share(self) -> Callable[[float], float] | None:
        """A function mapping this rank's iteration time to the max over the world, so every
        rank stops timing at the same iteration (the collectives' world); None without one."""
        return None

    def start_measuring(self) -> None:
        """Right before a timed iteration's clock starts (the memory meter's window opens)."""

    def stop_measuring(self) -> None:
        """Right after a timed iteration's clock stops, or when the replay stops inside one."""

    def on_iteration_start(self) -> None:
        """Called before the first op of every iteration (inside the clock)."""

    def settle(self) -> None:
        """Complete outstanding asynchronous work (async collectives): before a flush and at
        the end of every iteration, inside the clock."""

    def blocked_s(self) -> float:
        """Seconds spent issuing and waiting for communication since the replay began; an
        iteration's communication time is how much it grew."""
        return 0.0

    def on_iteration_end(self, measured: bool) -> None:
        """Called after the last op of every iteration (``measured``: a timed iteration)."""

    def report(self) -> dict:
        """Figures for the rank report, under ``name``."""
        return {}

    def headline(self) -> dict:
        """Figures for the top level of the rank report (the driver aggregates them)."""
        return {}

    # --- the run (on the driver, over every rank's report) --------------------------------
    @classmethod
    def summarize_ranks(cls, parts: list[dict]) -> dict | None:
        """The run summary's figures under ``name`` from the ranks' ``report()`` parts (the
        ranks that have one); None: the extension adds nothing to the summary."""
        return None

    def close(self) -> None:
        """The replay is over, or its build failed (the CPU meter gives torch its allocator
        back); safe to call more than once, and without ``attach``."""
