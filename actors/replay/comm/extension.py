"""Collectives as a replay extension: every collective op of the trace is issued through the
rebuilt process groups (actors/replay/comm/replayer.py), async ones completed right before
the first op that needs them, all of them before a flush and at the end of an iteration.

Its report section is the per-kind statistics (``collectives``); its world decides when every
rank stops timing (actors/replay/timed_iterations.py ``world_max``).
"""
from __future__ import annotations

from functools import partial

from actors.replay.extension_contract import ReplayContext, ReplayExtension
from actors.replay.timed_iterations import world_max


class Collectives(ReplayExtension):
    """Replays the trace's collectives with ``comm`` (a CollectiveReplayer)."""

    name = "collectives"

    def __init__(self, comm):
        self.comm = comm
        self._runs: dict = {}
        self._device = None

    def attach(self, ctx: ReplayContext) -> None:
        # full mode hands the compute ops' tensors to the collectives, comms mode none;
        # compute mode leaves them out of scope (actors/replay/step_plan.py compile_step)
        get = ctx.store.get if ctx.cfg.mode == "full" else None
        self._runs = {op.index: partial(self.comm.run, op, get) for op in ctx.trace.ops
                      if op.collective is not None} if ctx.cfg.mode != "compute" else {}
        self._device = ctx.device

    def hooks(self):
        """Async collectives complete before the first op using them (after a host gap there:
        a wait in it)."""
        return self.comm.hooks(), {}

    def runs(self):
        return self._runs

    def world_share(self):
        return world_max(self._device)

    def settle(self) -> None:
        self.comm.wait_all()

    def blocked_s(self) -> float:
        return self.comm.blocked_s

    def on_iteration_end(self, measured: bool) -> None:
        if not measured:  # forget what a warm-up iteration added to the statistics
            self.comm.stats.reset()

    def report(self) -> dict:
        return self.comm.stats_dict()
