"""One rank's outcome of a group call (orchestrator/cluster/worker_group.py), read where a
failure is explained (orchestrator/cluster/node_state.py): below both, so neither imports
the other for it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import OutOfMemoryError, RayActorError, RayError, RayTaskError

from actors.choices import Choice
from actors.errors import describe


class Outcome(Choice):
    """How one rank's group call ended (``Result.kind``)."""

    ok = "ok"  # ``value`` is set
    error = "error"  # the method raised
    died = "died"  # the actor process is gone
    timeout = "timeout"  # not done by the deadline
    aborted = "aborted"  # still running when the grace after another rank's failure ran out
    interrupted = "interrupted"  # still running when a signal stopped the driver


@dataclass
class Result:
    """One rank's outcome of a group call."""

    rank: int
    kind: Outcome
    value: Any = None
    error: str = ""
    node_ip: str | None = None  # where the rank's actor ran (None before placement)
    node_id: str | None = None

    @property
    def ok(self) -> bool:
        return self.kind == Outcome.ok



def outcome(rank: int, ref) -> Result:
    """The Result of a finished ref (ray.get does not block: the ref is ready)."""
    try:
        return Result(rank, Outcome.ok, value=ray.get(ref))
    except RayActorError as exc:
        return Result(rank, Outcome.died, error=f"rank {rank} actor died: {_first_line(exc)}")
    except OutOfMemoryError as exc:  # Ray's memory monitor killed the actor process
        return Result(rank, Outcome.died, error=f"rank {rank} actor killed by Ray's memory "
                                                f"monitor: {_first_line(exc)}")
    except RayError as exc:
        return Result(rank, Outcome.error, error=failure_text(exc))


def failure_text(exc: RayError) -> str:
    """A failed call in one line: a task's own exception (not Ray's wrapper around it, whose
    first line is only the task's name and pid), else Ray's error."""
    if isinstance(exc, RayTaskError):
        return describe(exc.cause if exc.cause is not None else exc)
    return f"{type(exc).__name__}: {_first_line(exc)}"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
