"""The one failure report: a rank that did not end with a report of its own iterations.

Written by the rank itself (actors/rank_actor.py: its replay raised), and by the driver for a
rank that sent nothing back (orchestrator/run/launch.py: its actor died, raised, hung) or was
never heard of (orchestrator/run/aggregate.py). The status is the exception's type's
(``status_of``): out of memory, a timeout (``TimeoutError`` and its subclasses: a collective
past its process group's timeout is raised as ``CollectiveTimeout``), else failed; never read
from the message text.
"""
from __future__ import annotations

import traceback
from dataclasses import dataclass

from actors.choices import Choice
from actors.errors import TracefleetError, describe
from actors.replay.out_of_memory import OutOfMemory


class FailureStatus(Choice):
    """How a rank failed (the values of orchestrator/status.py's RunStatus)."""

    oom = "oom"
    timeout = "timeout"
    failed = "failed"


class Writer(Choice):
    """Who wrote a failure report: it decides which fields it has, and their order."""

    rank = "rank"  # the rank's own: its node right after its rank, then what it was doing
    driver = "driver"  # the driver's stand-in for a rank that sent no report
    missing = "missing"  # a rank never heard of: no node either


def status_of(error: BaseException) -> FailureStatus:
    """The status a failure with ``error`` ends a rank with."""
    if isinstance(error, OutOfMemory):
        return FailureStatus.oom
    if isinstance(error, TimeoutError):
        return FailureStatus.timeout
    return FailureStatus.failed


@dataclass
class FailureReport:
    """One rank's failure; ``to_dict()`` is the row the driver aggregates."""

    rank: int
    status: str
    error: str | None
    last_op: str | None = None
    writer: Writer = Writer.driver
    node_ip: str | None = None
    node_id: str | None = None
    oom: dict | None = None  # the rank's own: its OutOfMemory's held and requested bytes
    phase: str | None = None  # the rank's own: what it was doing (load, rendezvous, ...)
    traceback: str | None = None  # the rank's own: where a defect (not a project error) was

    @classmethod
    def of_rank(cls, rank: int, error: BaseException, phase: str, op=None,
                where: dict | None = None) -> "FailureReport":
        """The rank's own report of ``error`` raised in ``phase`` at trace op ``op`` (None:
        before the first op); ``where`` its node (node_ip, node_id)."""
        status = status_of(error)
        oom = status == FailureStatus.oom
        detail = "" if isinstance(error, (TracefleetError, OutOfMemory)) else \
            "\n" + traceback.format_exc(limit=6)
        # before the first op: e.g. ZeRO-3 shards that do not fit the device capacity
        text = f"out of memory before the first op: {error}" if oom else \
            describe(error, phase, op)
        where = where or {}
        return cls(rank=rank, status=str(status), error=f"rank {rank}: {text}",
                   last_op=f"node {op.node_id} {op.name}" if op is not None else None,
                   writer=Writer.rank, node_ip=where.get("node_ip"),
                   node_id=where.get("node_id"),
                   oom={"node_id": None, "op": None, "held_bytes": error.held_bytes,
                        "requested_bytes": error.requested_bytes} if oom else None,
                   phase=phase, traceback=detail or None)

    @classmethod
    def missing(cls, rank: int, status: str) -> "FailureReport":
        """A rank the driver has no word from at all."""
        return cls(rank=rank, status=status, error="no report received from this rank",
                   writer=Writer.missing)

    def to_dict(self) -> dict:
        if self.writer == Writer.rank:
            return {"rank": self.rank, "node_ip": self.node_ip, "node_id": self.node_id,
                    "status": self.status, "error": self.error, "oom": self.oom,
                    "last_op": self.last_op, "phase": self.phase, "traceback": self.traceback}
        out = {"rank": self.rank, "status": self.status, "error": self.error,
               "last_op": self.last_op}
        if self.writer == Writer.driver:
            out.update(node_ip=self.node_ip, node_id=self.node_id)
        return out
