"""Connect the driver to Ray: start an embedded local cluster, or join a running one."""
from __future__ import annotations

import logging
import math
import os
import socket
import time
from dataclasses import dataclass

from actors.errors import ConfigError
from orchestrator import interrupts
from orchestrator.cluster import stale_cluster
from orchestrator.config import ClusterConfig
from orchestrator.errors import ClusterError

log = logging.getLogger(__name__)
_SHUTDOWN_WAIT_S = 5.0  # bound on the embedded cluster's processes exiting after ray.shutdown

# Ray 2.60 clusters use token authentication by default; a driver joining one by address
# must opt in and hold the cluster's token.
_AUTH_HINT = (
    "if the cluster uses token authentication (the default in Ray 2.60), set "
    "RAY_AUTH_MODE=token and provide the cluster's token via RAY_AUTH_TOKEN, "
    "RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token"
)


@dataclass
class ClusterHandle:
    """The driver's Ray session; ``shutdown()`` undoes only what ``connect()`` did."""

    started_ray: bool  # we started an embedded local cluster
    owns_connection: bool  # we called ray.init (False: Ray was already initialized)
    address: str  # GCS address of the cluster
    # this driver's child processes before Ray started: not Ray's, never stopped here
    pids_before: frozenset = frozenset()

    def shutdown(self) -> None:
        """Stop the embedded cluster, or disconnect from a joined one; never touch Ray
        that was initialized before ``connect()``. An embedded cluster's processes (GCS,
        raylet, dashboard and runtime-env agents, workers) are gone when this returns: any
        that outlives ``ray.shutdown()`` is killed by pid (stale_cluster.stop_survivors)."""
        import ray  # here, not at the top: predict and capture import this module, not Ray

        if self.owns_connection and ray.is_initialized():
            started = [p for p in stale_cluster.cluster_processes()
                       if p.pid not in self.pids_before] if self.started_ray else []
            ray.shutdown()
            stale_cluster.stop_survivors(started, _SHUTDOWN_WAIT_S)
        self.owns_connection = False


MIN_LOCAL_START_ATTEMPTS = 2  # Ray's node start, missed under load, is tried at least twice

def connect(cfg: ClusterConfig, world_size: int) -> ClusterHandle:
    """Start or join Ray for a run of ``world_size`` ranks.

    Reuses an already initialized Ray session (and then never shuts it down).
    Raises ClusterError if the address cannot be reached or refuses the connection.
    """
    cfg.validate()
    import ray

    if ray.is_initialized():
        log.info("Ray is already initialized; reusing the current session")
        return ClusterHandle(False, False, ray.get_runtime_context().gcs_address)
    if cfg.address is None:
        num_cpus = cfg.num_cpus or max(math.ceil(world_size * cfg.cpus_per_rank),
                                       os.cpu_count() or 1)
        if cfg.temp_dir:
            os.makedirs(cfg.temp_dir, exist_ok=True)
        before = frozenset(p.pid for p in stale_cluster.cluster_processes())
        _start_local(cfg, num_cpus, before)
        interrupts.reassert()  # Ray's driver replaced the SIGTERM handler (it aborts)
        return ClusterHandle(True, True, ray.get_runtime_context().gcs_address, before)
    if cfg.address != "auto" and not cfg.address.startswith("ray://"):
        # Ray retries an unreachable GCS for minutes; fail within our own bound instead.
        _check_reachable(cfg.address, min(cfg.timeout_s, 10.0))
    try:
        ray.init(address=cfg.address, log_to_driver=cfg.log_to_driver,
                 runtime_env=cfg.runtime_env)
    except (ConnectionError, ray.exceptions.AuthenticationError) as exc:
        raise ClusterError(
            f"cannot connect to the Ray cluster at cluster.address={cfg.address!r}: {exc}; "
            f"{_AUTH_HINT}") from exc
    interrupts.reassert()
    return ClusterHandle(False, True, ray.get_runtime_context().gcs_address)


def _start_local(cfg: ClusterConfig, num_cpus: int, before: frozenset) -> None:
    """``ray.init`` of a local cluster. Ray bounds its node's start at 30 s of its own, missed
    on a loaded machine: what that attempt started is stopped by pid and the start tried again,
    within ``cluster.timeout_s`` (at least twice), then a ClusterError in one line."""
    import ray

    start, attempt = time.monotonic(), 0
    while True:
        attempt += 1
        try:
            ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=cfg.log_to_driver,
                     _temp_dir=cfg.temp_dir, runtime_env=cfg.runtime_env)
            return
        except Exception as exc:  # noqa: BLE001 (Ray raises a bare Exception for it)
            if "timed out during startup" not in str(exc):
                raise
            ray.shutdown()
            for proc in stale_cluster.cluster_processes():
                if proc.pid not in before:
                    proc.kill()
            if attempt >= MIN_LOCAL_START_ATTEMPTS and \
                    time.monotonic() - start >= cfg.timeout_s:
                raise ClusterError(
                    f"the local Ray cluster did not start ({exc}) in {attempt} attempts within "
                    f"cluster.timeout_s={cfg.timeout_s:g} s; the machine may be overloaded: try "
                    "again, or join a running cluster with cluster.address") from None
            log.warning("the local Ray cluster did not start (%s); starting it again", exc)


def cuda_available_in_cluster() -> bool:
    """Whether the connected cluster has any GPU resource."""
    import ray

    if not ray.is_initialized():
        raise ClusterError("cuda_available_in_cluster() needs a Ray session: call connect() first")
    return ray.cluster_resources().get("GPU", 0) > 0


def _check_reachable(address: str, timeout_s: float) -> None:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ConfigError(f"cluster.address={address!r}: expected 'host:port', 'auto', "
                          f"'ray://host:port' or null")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            pass
    except OSError as exc:
        raise ClusterError(f"no Ray cluster answers at cluster.address={address!r} "
                           f"(TCP connect within {timeout_s:.0f} s failed: {exc})") from exc
