"""The per-rank report the actor ships to the driver (plain dict; names are a contract)."""
from __future__ import annotations

import socket
import statistics
from dataclasses import dataclass, field

from actors.replay.memory import cuda_memory_stats


@dataclass
class RankReport:
    """Measurements of one rank; `to_dict()` is what the driver aggregates."""

    rank: int
    device: str
    mode: str
    allocation_mode: str
    status: str = "ok"
    error: str | None = None
    last_op: str | None = None
    oom: dict | None = None
    iteration_times_s: list = field(default_factory=list)
    compute_times_s: list = field(default_factory=list)
    comm_times_s: list = field(default_factory=list)
    data: dict = field(default_factory=dict)

    @classmethod
    def start(cls, engine) -> "RankReport":
        return cls(rank=engine.rank, device=str(engine.device), mode=engine.cfg.mode,
                   allocation_mode=engine.cfg.allocation.mode)

    def add_iteration(self, elapsed_s: float, compute_s: float, comm_s: float) -> None:
        self.iteration_times_s.append(elapsed_s)
        self.compute_times_s.append(compute_s)
        self.comm_times_s.append(comm_s)

    def set_oom(self, op, held_bytes: int, requested_bytes: int, message: str | None = None):
        where = f"node {op.node_id} {op.name}" if op is not None else "before the first op"
        self.status = "oom"
        self.oom = {"node_id": op.node_id if op else None, "op": op.name if op else None,
                    "held_bytes": held_bytes, "requested_bytes": requested_bytes}
        self.error = message or (f"out of memory at {where}: {held_bytes} B held, "
                                 f"{requested_bytes} B requested")

    def finish(self, engine) -> "RankReport":
        replayed, in_scope, reasons = engine.coverage()
        op = engine.last_op
        self.last_op = f"node {op.node_id} {op.name}" if op is not None else None
        med = statistics.median
        self.data = {
            "num_ops": len(engine.steps), "num_in_scope": in_scope, "num_replayed": replayed,
            "num_skipped": in_scope - replayed, "skipped_reasons": dict(reasons),
            "coverage": replayed / in_scope if in_scope else 1.0,
            "num_shape_mismatches": engine.num_shape_mismatches,
            "iteration_time_s": med(self.iteration_times_s) if self.iteration_times_s else None,
            "compute_time_s": med(self.compute_times_s) if self.compute_times_s else None,
            "comm_time_s": med(self.comm_times_s) if self.comm_times_s else None,
            "peak_memory_bytes": engine.memory.peak_bytes,
            "liveness_lower_bound_bytes": engine.liveness.lower_bound_bytes,
            "device_memory_capacity_bytes": engine.memory.capacity_bytes,
            "num_flushes": engine.num_flushes, "flushed_bytes": engine.flushed_bytes,
            "num_materialized": engine.store.num_materialized,
            "memory_timeline": [list(p) for p in engine.memory.timeline],
            "top_ops": engine.top_ops(),
            "collectives": engine.comm.stats_dict() if engine.comm is not None else {},
            "cuda_memory": cuda_memory_stats(engine.device),
        }
        return self

    def to_dict(self) -> dict:
        d = {"rank": self.rank, "node_ip": _node_ip(), "device": self.device, "mode": self.mode,
             "allocation_mode": self.allocation_mode, "status": self.status, "error": self.error,
             "last_op": self.last_op, "oom": self.oom, "iteration_times_s": self.iteration_times_s}
        d.update(self.data)
        return d


def _node_ip() -> str:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"
