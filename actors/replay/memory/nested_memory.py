"""Memory only nested ops touched, held when the original held it (``faithful`` mode).

The trace's nested lifetimes (actors/trace/nested_lifetimes.py): a made-inside storage is
charged from the op whose nested op allocated it until its first top-level use, where the
replay allocates it itself; a storage no top-level op uses is charged from that op until the
last op a nested op read it in. On cpu and cuda the bytes are really allocated, so the
measured peak sees them too; on meta they are accounted.
"""
from __future__ import annotations

import torch

from actors.replay.extension_contract import ReplayContext, ReplayExtension
from actors.trace.categories import MADE_INSIDE


class NestedMemory(ReplayExtension):
    """Charges the trace's nested lifetimes around the ops (see the module docstring)."""

    name = "nested_memory"

    def __init__(self, lifetimes: tuple):
        self.lifetimes = lifetimes
        self.held: dict[int, torch.Tensor] = {}  # lifetime index -> its bytes
        self.host: frozenset = frozenset()
        self.memory = None
        self.device = None
        self.peak_held_bytes = 0

    def attach(self, ctx: ReplayContext) -> None:
        self.memory, self.device = ctx.memory, ctx.device
        self.host = ctx.trace.host_storages  # kept in host memory: charged as the host's
        owned = set().union(*(e.owned_storages() for e in ctx.extensions if e is not self))
        self.lifetimes = tuple(lt for lt in self.lifetimes if lt[0] not in owned)

    def hooks(self):
        """Charge after the allocating op; hand over before the first top-level use (a
        made-inside storage), or free after the last op a nested op read it in."""
        before, after = {}, {}
        for k, (suid, start, end, nbytes) in enumerate(self.lifetimes):
            after.setdefault(start, []).append(lambda k=k, n=nbytes: self._charge(k, n))
            release = (lambda k=k: self._release(k))
            (before if suid >= 0 else after).setdefault(end, []).append(release)
        return before, after

    def _charged_as(self, k: int) -> tuple[int, bool]:
        """What lifetime ``k`` is charged as, (category, host): a made-inside storage as what
        it holds (an activation saved for backward from a forward op is one, host memory where
        activations are offloaded), on the host where the trace names it so (a step's
        save_on_cpu copy); a storage no top-level op uses as made inside."""
        suid = self.lifetimes[k][0]
        if suid < 0:
            return MADE_INSIDE, False
        return self.memory.categories[suid], suid in self.host

    def _charge(self, k: int, nbytes: int) -> None:
        if k in self.held:
            return
        self.memory.charge(nbytes, *self._charged_as(k))
        self.held[k] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        held = sum(x.numel() for x in self.held.values())
        self.peak_held_bytes = max(self.peak_held_bytes, held)

    def _release(self, k: int) -> None:
        x = self.held.pop(k, None)
        if x is not None:
            self.memory.discharge(x.numel(), *self._charged_as(k))

    def on_iteration_end(self, measured: bool) -> None:
        for k in list(self.held):
            self._release(k)

    def report(self) -> dict:
        return {"num_lifetimes": len(self.lifetimes),
                "num_hidden": sum(1 for lt in self.lifetimes if lt[0] < 0),
                "peak_held_bytes": self.peak_held_bytes}
