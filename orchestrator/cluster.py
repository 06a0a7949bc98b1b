"""Connect the driver to Ray: start an embedded local cluster, or join a running one."""
from __future__ import annotations

import logging
import math
import os
import socket
from dataclasses import dataclass

from actors.choices import Choice
from actors.errors import ConfigError
from orchestrator.errors import ClusterError

log = logging.getLogger(__name__)



class PlacementStrategy(Choice):
    """Ray placement-group strategies for the rank bundles."""

    PACK = "PACK"
    SPREAD = "SPREAD"
    STRICT_PACK = "STRICT_PACK"
    STRICT_SPREAD = "STRICT_SPREAD"


# Ray 2.60 clusters use token authentication by default; a driver joining one by address
# must opt in and hold the cluster's token.
_AUTH_HINT = (
    "if the cluster uses token authentication (the default in Ray 2.60), set "
    "RAY_AUTH_MODE=token and provide the cluster's token via RAY_AUTH_TOKEN, "
    "RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token"
)


@dataclass
class ClusterConfig:
    """Where the rank actors run and how they are placed."""

    # None starts an embedded local Ray; "auto", "ray://host:port" or "host:port" joins
    # a running cluster.
    address: str | None = None
    # Logical CPUs of the embedded cluster; None = max(world_size * cpus_per_rank,
    # os.cpu_count()). Ignored when joining a cluster.
    num_cpus: int | None = None
    # Ray placement-group strategy for the rank bundles: PACK, SPREAD, STRICT_PACK or
    # STRICT_SPREAD.
    placement_strategy: PlacementStrategy = PlacementStrategy.PACK
    # Bound in seconds for each start-up phase: placement, actor start, rendezvous.
    timeout_s: float = 120.0
    # Logical CPUs reserved for each rank actor (its placement bundle).
    cpus_per_rank: float = 1.0
    # Root temp dir of the embedded cluster; keep it short (Ray puts unix sockets
    # under it, and socket paths are limited to ~107 bytes). None = Ray's default.
    temp_dir: str | None = None
    # Ray runtime_env applied to the job (env_vars, working_dir, pip, ...).
    runtime_env: dict | None = None
    # Stream the actors' stdout/stderr to the driver.
    log_to_driver: bool = True

    def __post_init__(self):
        self.placement_strategy = PlacementStrategy.coerce(self.placement_strategy,
                                                           "cluster.placement_strategy")

    def validate(self) -> None:
        """Raise ConfigError on a value Ray would reject later with a less clear message."""
        if not self.timeout_s > 0:
            raise ConfigError(f"cluster.timeout_s={self.timeout_s}: expected > 0")
        if not self.cpus_per_rank > 0:
            raise ConfigError(f"cluster.cpus_per_rank={self.cpus_per_rank}: expected > 0")
        if self.num_cpus is not None and self.num_cpus < 1:
            raise ConfigError(f"cluster.num_cpus={self.num_cpus}: expected >= 1 or null")


@dataclass
class ClusterHandle:
    """The driver's Ray session; ``shutdown()`` undoes only what ``connect()`` did."""

    started_ray: bool  # we started an embedded local cluster
    owns_connection: bool  # we called ray.init (False: Ray was already initialized)
    address: str  # GCS address of the cluster

    def shutdown(self) -> None:
        """Stop the embedded cluster, or disconnect from a joined one; never touch Ray
        that was initialized before ``connect()``."""
        import ray  # here, not at the top: predict and capture import this module, not Ray

        if self.owns_connection and ray.is_initialized():
            ray.shutdown()
        self.owns_connection = False


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
        ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=cfg.log_to_driver,
                 _temp_dir=cfg.temp_dir, runtime_env=cfg.runtime_env)
        return ClusterHandle(True, True, ray.get_runtime_context().gcs_address)
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
    return ClusterHandle(False, True, ray.get_runtime_context().gcs_address)


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
