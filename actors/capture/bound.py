"""The limits one recording on meta or fake runs under: time (actors/time_limit.py) and
resident memory (actors/memory_limit.py). A value, not a closure: a worker process or a Ray
task recording a mesh job's role makes the very context this process would."""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

from actors.memory_limit import memory_limit
from actors.time_limit import time_limit


@dataclass(frozen=True)
class RecordingBound:
    """``bound(what)``: the context one recording runs in; ``*_key`` name the settings an
    error names (the caller's own: ``capture_timeout_s``, ``predict.capture_timeout_s``)."""

    device: str  # meta or fake: named in the errors
    timeout_s: float  # 0: no time bound
    timeout_key: str = "capture_timeout_s"
    stall_s: float = 0.0  # 0: no stall bound
    stall_key: str = "capture_stall_s"
    memory_bytes: int = 0  # resident memory of the recording process; 0: no bound
    memory_key: str = "roles.memory_limit_gib"

    @contextmanager
    def __call__(self, what: str):
        what = f"the {self.device} capture's {what}"
        with time_limit(self.timeout_s, self.timeout_key, what, stall_s=self.stall_s,
                        stall_key=self.stall_key), \
                memory_limit(self.memory_bytes, self.memory_key, what):
            yield
