"""The caching allocator model's memory over the last iteration, for ``prediction.html``:
allocated bytes by category (they stack up to the allocated line), the reserved line, and the
two peaks with where they happened (the reserved one split by stream, the allocated one by
category: a peak one op wide is a sub-pixel spike on the plot).

Sampled at every allocation and free (nothing changes in between), downsampled into buckets
of ops: a bucket keeps the state at its highest allocated point (categories and allocated
bytes of one instant) and its highest reserved bytes, so no peak is lost between points.
"""
from __future__ import annotations

from actors.replay.memory.allocator_events import NO_CATEGORY
from actors.trace.categories import CATEGORIES
from actors.trace.fsdp2_streams import (ALL_GATHER_COPY_IN_STREAM, COMPUTE_STREAM,
                                        REDUCE_SCATTER_STREAM)

MAX_POINTS = 512  # a page's plot is ~1000 px wide; prediction.json stays ~50 KB
# the allocated bytes by category, in this order; the cuBLAS workspace is the one request
# that is no trace storage
SERIES = (*CATEGORIES, "cublas_workspace")
STREAM_NAMES = {COMPUTE_STREAM: "compute", ALL_GATHER_COPY_IN_STREAM: "FSDP2 all-gather copy-in",
                REDUCE_SCATTER_STREAM: "FSDP2 reduce-scatter"}
_INDEX = {**{i: i for i in range(len(CATEGORIES))}, NO_CATEGORY: len(CATEGORIES)}


class PredictedTimeline:
    """Buckets of ``stride`` ops over the current iteration, and the run's two peaks."""

    def __init__(self, model, num_ops: int, max_points: int = MAX_POINTS):
        self.model = model  # a RecordingAllocatorModel
        self.stride = max(1, -(-num_ops // max_points))
        self.iteration = 0  # 1-based; 0 before the first
        self.points: list[list[int]] = []
        self._bucket = None
        self._high = -1  # the bucket's highest allocated bytes so far
        self._at_high: list[int] = []
        self._reserved_high = 0
        self._reserved_peak = self._allocated_peak = -1
        self.reserved_peak: dict | None = None
        self.allocated_peak: dict | None = None

    def start_iteration(self) -> None:
        """Forget the previous iteration's points (the last one is kept)."""
        self.flush()
        self.iteration += 1
        self.points = []

    def update(self, op_index: int) -> None:
        """After a request or free at op ``op_index`` (-1: before the first op)."""
        m = self.model
        bucket = op_index // self.stride if op_index >= 0 else -1
        if bucket != self._bucket:
            self.flush()
            self._bucket = bucket
        allocated, reserved = m.allocated_bytes, m.reserved_bytes
        if allocated > self._high:
            self._high = allocated
            self._at_high = [op_index, *self._by_series()]
        if reserved > self._reserved_high:
            self._reserved_high = reserved
        if reserved > self._reserved_peak:
            self._reserved_peak = reserved
            self.reserved_peak = {
                "bytes": reserved, "iteration": self.iteration, "op_index": op_index,
                "by_stream": {STREAM_NAMES.get(s, f"stream {s}"): b
                              for s, b in sorted(m.stream_reserved.items()) if b}}
        if allocated > self._allocated_peak:
            self._allocated_peak = allocated
            # a new allocated peak is this bucket's high too: _at_high holds its stack
            self.allocated_peak = {"bytes": allocated, "iteration": self.iteration,
                                   "op_index": op_index,
                                   "by_series": {name: b for name, b in
                                                 zip(SERIES, self._at_high[1:]) if b}}

    def _by_series(self) -> list[int]:
        out = [0] * len(SERIES)
        for cat, nbytes in self.model.category_bytes.items():
            out[_INDEX[cat]] += nbytes
        return out

    def flush(self) -> None:
        """Close the current bucket: one point ``[op index, allocated, reserved, *SERIES]``."""
        if self._bucket is not None and self._high >= 0:
            op, *series = self._at_high
            self.points.append([op, self._high, self._reserved_high, *series])
        self._bucket, self._high, self._reserved_high = None, -1, 0

    def report(self, num_warmup_iters: int) -> dict:
        self.flush()
        return {"iteration": self.iteration, "measured": self.iteration > num_warmup_iters,
                "ops_per_point": self.stride, "series": list(SERIES),
                "columns": ["op_index", "allocated_bytes", "reserved_bytes", *SERIES],
                "points": self.points, "reserved_peak": self.reserved_peak,
                "allocated_peak": self.allocated_peak}
