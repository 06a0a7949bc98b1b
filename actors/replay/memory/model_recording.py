"""The reserved-memory model (reserved_model.py) that also keeps what a user looks at: the
memory snapshot in torch's layout (replay.allocator_snapshot; actors/replay/memory/snapshot.py)
and the predicted timeline (replay.allocator_timeline; actors/replay/memory/predicted_timeline.py).

Every request and free is tagged with what runs (the iteration and the op, from the
MemoryTracker's step) and the storage's category. The plain model is used when neither is asked
for, so a prediction without them pays nothing for them.
"""
from __future__ import annotations

import time

from actors.replay.extension_contract import ReplayContext
from actors.replay.memory.allocator_events import NO_CATEGORY, RecordingAllocatorModel
from actors.replay.memory.predicted_timeline import PredictedTimeline
from actors.replay.memory.reserved_model import ReservedMemoryModel
from actors.replay.memory.snapshot import FrameTable, build_snapshot, snapshot_bytes
from actors.replay.memory.target import TargetConfig
from actors.trace.categories import TEMPORARIES

SNAPSHOT_KEY = "snapshot_pickle"  # the pickled snapshot's key in the cuda_allocator report
TIMELINE_KEY = "timeline"


class RecordingReservedModel(ReservedMemoryModel):
    """ReservedMemoryModel over a RecordingAllocatorModel."""

    def __init__(self, target: TargetConfig, snapshot: bool = True, timeline: bool = True):
        super().__init__(target)
        self.model = RecordingAllocatorModel(self.settings, self.figures["usable_capacity_bytes"],
                                             self.figures["device_memory_bytes"],
                                             record_events=snapshot)
        self.snapshot, self.timeline = snapshot, None
        self._want_timeline = timeline
        self._table: FrameTable | None = None
        self._num_warmup = 0
        self._iteration = -1  # 0-based; -1 before the first
        self.snapshot_s = 0.0  # seconds spent building and pickling the snapshot

    def attach(self, ctx: ReplayContext) -> None:
        self._table = FrameTable(ctx.trace.ops, ctx.cfg.warmup_iters)
        self._num_warmup = ctx.cfg.warmup_iters
        if self._want_timeline:
            self.timeline = PredictedTimeline(self.model, len(ctx.trace.ops))
        super().attach(ctx)  # serves the cuBLAS workspace: untagged, of no category
        if self.timeline is not None:
            self.timeline.update(-1)

    def on_iteration_start(self) -> None:
        self._iteration += 1
        if self.timeline is not None:
            self.timeline.start_iteration()

    # --- tagging each request and free -----------------------------------------------------
    def _op_index(self) -> int:
        step = self._memory.step
        if step is None:
            return -1
        return step.op.index if step.op is not None else step.at

    def _tag(self, category: int) -> int:
        """Tag the model's next event; returns the op index."""
        index = self._op_index()
        self.model.tag = self._table.tag(self._iteration, index)
        self.model.category = category
        return index

    def _after(self, index: int) -> None:
        if self.timeline is not None:
            self.timeline.update(index)

    def _malloc(self, suid: int, nbytes: int) -> None:
        index = self._tag(self._memory.categories[suid])
        super()._malloc(suid, nbytes)
        self._after(index)

    def released(self, suid: int) -> None:
        index = self._tag(NO_CATEGORY)
        super().released(suid)
        self._after(index)

    def charged(self, nbytes: int, category: int = TEMPORARIES, host: bool = False) -> None:
        if host:  # not the device's: no allocation to record
            super().charged(nbytes, category, host)
            return
        index = self._tag(category)
        super().charged(nbytes, category)
        self._after(index)

    def discharged(self, nbytes: int, category: int = TEMPORARIES, host: bool = False) -> None:
        if host:
            super().discharged(nbytes, category, host)
            return
        index = self._tag(category)
        super().discharged(nbytes, category)
        self._after(index)

    # --- report -----------------------------------------------------------------------------
    def report(self) -> dict:
        out = super().report()
        if self.timeline is not None:
            out[TIMELINE_KEY] = self.timeline.report(self._num_warmup)
        if self.snapshot:
            start = time.perf_counter()
            snap = build_snapshot(self.model, self._table, {
                "predicted": True, "target": self.figures["name"],
                "usable_capacity_bytes": self.figures["usable_capacity_bytes"],
                "num_iterations": self._iteration + 1, "num_warmup_iters": self._num_warmup})
            out[SNAPSHOT_KEY] = snapshot_bytes(snap)
            self.snapshot_s = time.perf_counter() - start
            out["snapshot_s"] = self.snapshot_s
        return out

    def close(self) -> None:
        """Let go of the trace's ops (the frame table): the replay's MemoryTracker, which holds
        this model as a listener, lies on a reference cycle of its own, and with the GC off
        (tracefleet-predict's command) it kept the ops of every stage to the end (0.5 GB a
        405B stage)."""
        self._table = None
        super().close()


def pop_snapshot(rank_report: dict) -> bytes | None:
    """Take the pickled snapshot off a rank report (it is not JSON: files get it, not the
    summary); None when the replay recorded none."""
    allocator = rank_report.get("cuda_allocator")
    if not isinstance(allocator, dict):
        return None
    return allocator.pop(SNAPSHOT_KEY, None)


def reserved_model_extensions(target: TargetConfig | None, snapshot: bool = False,
                              timeline: bool = False) -> list:
    """The model as a replay extension when ``target`` names a device, else none; with
    ``snapshot`` or ``timeline``, the recording model above, which keeps its history."""
    if target is None or not target.enabled:
        return []
    if snapshot or timeline:
        return [RecordingReservedModel(target, snapshot=snapshot, timeline=timeline)]
    return [ReservedMemoryModel(target)]
