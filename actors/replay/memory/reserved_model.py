"""Predicted reserved memory: the caching allocator model (cuda_allocator.py) fed with the
replay's allocations and frees, on any replay device (meta dry runs and CPU replays alike).

The stream is what the replay accounts: a storage becomes held (an op made it, or the replay
materialized it) with its bytes, then released; an extension's charge (ZeRO-3's gathered
buffers, shards) is one allocation and its discharge frees the latest charge of that size.
It lacks what the real run allocates inside ops (temporaries, workspaces other than cuBLAS's).
Storages FSDP2 allocates on its all-gather copy-in and reduce-scatter streams are served from
those streams' own pools (actors/trace/fsdp2_streams.py), everything else from the compute
stream's. The cuBLAS workspace is the first request, kept for the whole run, as PyTorch keeps
it per handle and stream. The optimizer's state, held from before the replay, is requested when
the warm-up iteration's optimizer step first allocates: torch.optim makes it lazily in the first
``step()`` (``zeros_like`` per parameter), after the first backward, so it is carved out of the
blocks the activations left cached rather than reserved ahead of them. Storages of the
target's ``host_categories`` (host offload) are not the device's: counted apart, as host bytes,
as are the trace's own host storages (``Trace.host_storages``: a step's save_on_cpu copies)
and an extension's charges marked ``host`` (the ZeRO-3 emulation's DeepSpeed offload).
"""
from __future__ import annotations

from actors.replay.memory.cuda_allocator import CachingAllocatorModel
from actors.trace.categories import CATEGORIES, OPTIMIZER_STATE, TEMPORARIES
from actors.trace.fsdp2_streams import side_stream_storages
from actors.replay.extension_contract import ReplayContext, ReplayExtension
from actors.replay.memory.target import TargetConfig

OPTIMIZER_RANGE = "Optimizer.step"  # torch.optim's record_function around every step()
HEADLINE = ("predicted_reserved_peak_bytes", "predicted_allocated_peak_bytes", "num_alloc_retries",
            "num_predicted_ooms")


class ReservedMemoryModel(ReplayExtension):
    """Runs the caching allocator model of ``target`` over one rank's replay."""

    name = "cuda_allocator"

    def __init__(self, target: TargetConfig):
        self.figures = target.figures()
        self.settings = target.allocator.settings()
        self.model = CachingAllocatorModel(self.settings, self.figures["usable_capacity_bytes"],
                                           self.figures["device_memory_bytes"])
        self._blocks: dict[int, object] = {}  # suid -> its block
        self._charges: dict[int, list] = {}  # charged size -> blocks, latest last
        self._streams: dict[int, int] = {}  # suid -> its side stream (absent: compute stream)
        self._memory = None  # the replay's MemoryTracker (its step and categories)
        # optimizer-state suid -> bytes, held before the replay and not yet requested (None:
        # requested as held, the trace having no optimizer step to make it lazily in)
        self._lazy_state: dict[int, int] | None = None
        self.num_unmatched_discharges = 0
        # categories kept in host memory (target.host_categories): not the device's
        self._host = {CATEGORIES.index(c) for c in target.host_categories}
        self._host_storages: frozenset = frozenset()  # the trace's own host storages
        self._host_held: dict[int, int] = {}  # host suid -> bytes
        self.host_bytes = self.host_peak_bytes = 0

    def attach(self, ctx: ReplayContext) -> None:
        """Observe the replay's memory; serve the cuBLAS workspace first."""
        self._streams = side_stream_storages(ctx.trace.ops)
        self._host_storages = ctx.trace.host_storages
        self._memory = ctx.memory
        if any(op.module.startswith(OPTIMIZER_RANGE) for op in ctx.trace.ops):
            self._lazy_state = {}
        if self.figures["cublas_workspace_bytes"]:
            self.model.malloc(self.figures["cublas_workspace_bytes"])
        ctx.memory.observe(self)

    # --- the MemoryTracker observer ------------------------------------------------------
    def held(self, suid: int, nbytes: int) -> None:
        if suid in self._host_storages or \
                self._host and self._memory.categories[suid] in self._host:
            self._host_held[suid] = nbytes
            self.host_bytes += nbytes
            self.host_peak_bytes = max(self.host_peak_bytes, self.host_bytes)
            return
        lazy = self._lazy_state
        if lazy is not None:
            step = self._memory.step  # None: before the first op, the state already held
            if step is None and self._memory.categories[suid] == OPTIMIZER_STATE:
                lazy[suid] = nbytes
                return
            if step is not None and step.op is not None and \
                    step.op.module.startswith(OPTIMIZER_RANGE):
                self._request_lazy_state()
        self._malloc(suid, nbytes)

    def _malloc(self, suid: int, nbytes: int) -> None:
        """Serve storage ``suid`` from its stream's pools."""
        self._blocks[suid] = self.model.malloc(nbytes, self._streams.get(suid, 0))

    def _request_lazy_state(self) -> None:
        """Serve the optimizer state set aside at attach (its first step makes it)."""
        lazy, self._lazy_state = self._lazy_state, None
        for suid, nbytes in lazy.items():
            self._malloc(suid, nbytes)

    def on_iteration_end(self, measured: bool) -> None:
        if self._lazy_state is not None:  # the optimizer step allocated nothing: serve it now
            self._request_lazy_state()

    def released(self, suid: int) -> None:
        if suid in self._host_held:
            self.host_bytes -= self._host_held.pop(suid)
            return
        if self._lazy_state:
            self._lazy_state.pop(suid, None)
        block = self._blocks.pop(suid, None)
        if block is not None:
            self.model.free(block)

    def charged(self, nbytes: int, category: int = TEMPORARIES, host: bool = False) -> None:
        if host or category in self._host:  # an extension's host memory (DeepSpeed's offload)
            self.host_bytes += nbytes
            self.host_peak_bytes = max(self.host_peak_bytes, self.host_bytes)
        elif nbytes > 0:
            self._charges.setdefault(nbytes, []).append(self.model.malloc(nbytes))

    def discharged(self, nbytes: int, category: int = TEMPORARIES, host: bool = False) -> None:
        if host or category in self._host:
            self.host_bytes -= nbytes
            return
        blocks = self._charges.get(nbytes)
        if blocks:
            self.model.free(blocks.pop())
        elif nbytes > 0:  # not one earlier charge: left allocated, and counted
            self.num_unmatched_discharges += 1

    # --- report -----------------------------------------------------------------------------
    def report(self) -> dict:
        stats = self.model.stats()
        return {**stats, "target": self.figures,
                "settings": {"max_split_size_bytes": self.settings.max_split_size_bytes,
                             "expandable_segments": self.settings.expandable_segments,
                             "roundup_power2_divisions": self.settings.roundup_power2_divisions,
                             "garbage_collection_threshold":
                                 self.settings.garbage_collection_threshold},
                "num_unmatched_discharges": self.num_unmatched_discharges,
                "host_categories": sorted(CATEGORIES[c] for c in self._host),
                "host_peak_bytes": self.host_peak_bytes,
                "streams": len({stream for stream, _ in self.model.pools})}

    def headline(self) -> dict:
        stats = {**self.model.stats(), "num_predicted_ooms": self.model.num_ooms}
        return {k: stats[k] for k in HEADLINE}
