"""How a mesh job's roles are recorded on fake (orchestrator/run/roles.py records them): a
config light to import, since every capture and prediction composes it."""
from __future__ import annotations

from dataclasses import dataclass

from actors.config_fields import setting
from actors.errors import ConfigError
from orchestrator.config import Executor


@dataclass
class RolesConfig:
    """How the roles of a mesh job captured on fake are recorded."""

    num_workers: int = setting(1, help=(
        "Roles recorded at once (pipeline stages, context-parallel chunks: one recorded rank "
        "each). 1: one after another in this process. N > 1: N at a time, each in a process "
        "of its own. 0: as many as this machine holds: the first role is recorded alone and "
        "its measured peak resident memory sizes the rest (CPUs, available memory). With the "
        "local executor, tracefleet-predict then dry-runs the roles' traces N (0: as many as "
        "CPUs) at once too."))
    executor: Executor = setting(Executor.local, help=(
        "local: worker processes on this machine. ray: Ray tasks on the cluster at "
        "ray_address, spread over its nodes (one CPU each, and memory_limit_gib of memory "
        "reserved); their trace files come back through Ray's object store."))
    memory_limit_gib: float = setting(0.0, help=(
        "Bound on one role's recording, GiB of resident memory (0: none): a recording past "
        "it stops with an error naming the role and the size it reached."))
    ray_address: str | None = setting(None, help=(
        "executor=ray: the Ray cluster (host:port, or auto); null starts a local one for the "
        "capture."))

    def validate(self, key: str = "roles") -> None:
        """ConfigError on values no executor can honour."""
        if isinstance(self.num_workers, bool) or self.num_workers < 0:
            raise ConfigError(f"{key}.num_workers={self.num_workers!r}; expected 0 (as many as "
                              "the machine holds) or a count >= 1")
        if not self.memory_limit_gib >= 0:
            raise ConfigError(f"{key}.memory_limit_gib={self.memory_limit_gib!r}; expected GiB "
                              ">= 0 (0: no bound)")
        if self.executor == Executor.ray and self.num_workers == 0:
            raise ConfigError(f"{key}.executor=ray with {key}.num_workers=0: on a cluster, say "
                              "how many roles run at once (the local sizing reads this "
                              "machine's memory)")
