"""Room for an op that may not fit: flush at the threshold, out of memory at the capacity.

The op loop checks one number per op (held bytes against the op's limit, step_plan.py
``set_fast_path``); only above it does it ask ``make_room``, which counts what the op would
add, flushes when that crosses ``replay.allocation.device_memory_threshold`` and raises
OutOfMemory when it still does not fit the capacity.
"""
from __future__ import annotations

from typing import Callable

from actors.replay.memory.accounting import MemoryTracker
from actors.replay.out_of_memory import OutOfMemory
from actors.replay.memory.tensor_store import TensorStore


class Room:
    """Flushes and OOMs of one replay; ``settle`` completes outstanding asynchronous work
    (async collectives) before a flush drops anything."""

    def __init__(self, memory: MemoryTracker, store: TensorStore, storage_bytes: list[int],
                 flush_bytes: float | None, settle: Callable[[], None]):
        self.memory, self.store, self.sizes = memory, store, storage_bytes
        self.flush_bytes = flush_bytes  # the flush threshold in bytes (None: never flush)
        limits = [x for x in (flush_bytes, memory.capacity_bytes) if x is not None]
        # held bytes above which an op may not fit (threshold or capacity)
        self.guard = min(limits) if limits else float("inf")
        self.settle = settle
        self.num_flushes = 0
        self.flushed_bytes = 0

    def make_room(self, step) -> bool:
        """Before an op that may not fit: flush when held + what the op needs would cross the
        threshold, then raise OutOfMemory if it still does not fit the capacity. Returns
        whether it flushed."""
        memory, sizes = self.memory, self.sizes
        held = memory.held
        need = sum(sizes[s] for s in step.touch if not held[s])
        flushed = self.flush_bytes is not None and memory.held_bytes + need > self.flush_bytes
        if flushed:
            self.flush(step.op.index)
            need = sum(sizes[s] for s in step.touch if not held[s])  # flushed inputs return
        cap = memory.capacity_bytes
        if cap is not None and memory.held_bytes + need > cap:
            raise OutOfMemory(memory.held_bytes, need, cap)
        return flushed

    def flush(self, op_index: int) -> None:
        """Drop every storage the policy lets go (outstanding collectives complete first)."""
        self.settle()
        freed = self.store.free_all()
        if freed and self.memory.recording:  # counted per iteration (they all flush alike);
            self.num_flushes += 1            # a flush that could drop nothing did not happen
            self.flushed_bytes += freed
            self.memory.note_flush(op_index)
