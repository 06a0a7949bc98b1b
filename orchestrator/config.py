"""The run's structured config: components' dataclasses composed into ``RunConfig``.

The rank side's components own their dataclass next to their code (``ReplayConfig`` in
actors/replay, ``Zero3Config`` in actors/zero3). The driver's sections live on its ground
floor, below every layer that reads them: the cluster's here, the studies' in
orchestrator/study_config.py; so this module imports no layer of the driver. It composes
them, and registers one schema per config group in Hydra's ConfigStore
(``store_group_schemas``, which every ``compose`` calls; the commands' root schemas are
orchestrator/cli/schemas.py's); YAML files in ``conf/`` (``CONF_DIR``, the one definition of
where they are) pick and override.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

from hydra import compose as hydra_compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig

from actors.config_fields import check_finite
from actors.choices import Choice
from actors.config_fields import setting
from actors.errors import ConfigError
from actors.replay.config import ReplayConfig, parse_bytes
from actors.replay.memory.target import TargetConfig
from actors.trace.parsed_cache import DEFAULT_DIR as PARSED_CACHE_DIR
from actors.zero3.config import Zero3Config, Zero3Strategy  # noqa: F401 (composed here)
from orchestrator.study_config import MinMemoryConfig, OomStudyConfig

REPO_ROOT = Path(__file__).resolve().parents[1]
CONF_DIR = REPO_ROOT / "conf"
DEMO_TRACES = REPO_ROOT / "demo" / "traces"
WORKLOAD_CONF_DIR = CONF_DIR / "workload"  # the capture workload presets
# Hydra's GlobalHydra is one per process: two threads composing at once would collide
_COMPOSING = threading.Lock()


def compose(config_name: str | None, overrides: list[str]) -> DictConfig:
    """``conf/<config_name>.yaml`` (None: an empty root) composed with command-line
    ``overrides`` through Hydra's compose API, one composition at a time. The group schemas
    the presets name are stored first (``store_group_schemas``); a command's root schema
    (``config_name``) must be registered (orchestrator/cli/schemas.py's register_all: every
    command registers it on start). Inside a command's own Hydra app (tracefleet's OOM study
    composes its workload preset while ``tracefleet`` runs), Hydra is initialized on conf/
    already and cannot be initialized twice: the app's is used."""
    store_group_schemas()
    with _COMPOSING:
        if GlobalHydra.instance().is_initialized():
            return hydra_compose(config_name=config_name, overrides=overrides)
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            return hydra_compose(config_name=config_name, overrides=overrides)


class PlacementStrategy(Choice):
    """Ray placement-group strategies for the rank bundles."""

    PACK = "PACK"
    SPREAD = "SPREAD"
    STRICT_PACK = "STRICT_PACK"
    STRICT_SPREAD = "STRICT_SPREAD"


@dataclass
class ClusterConfig:
    """Where the rank actors run and how they are placed."""

    address: str | None = setting(None, help=(
        "None starts an embedded local Ray; \"auto\", \"ray://host:port\" or \"host:port\" "
        "joins a running cluster."))
    num_cpus: int | None = setting(None, help=(
        "Logical CPUs of the embedded cluster; None = max(world_size * cpus_per_rank, "
        "os.cpu_count()). Ignored when joining a cluster."))
    placement_strategy: PlacementStrategy = setting(PlacementStrategy.PACK, help=(
        "Ray placement-group strategy for the rank bundles: PACK, SPREAD, STRICT_PACK or "
        "STRICT_SPREAD."))
    timeout_s: float = setting(300.0, help=(
        "Bound in seconds for each start-up phase: placement, actor start, rendezvous. A bound "
        "on a hang, not a speed target: four actors importing torch on a busy 2-core machine "
        "took over 120 s to start."))
    cpus_per_rank: float = setting(1.0, help=(
        "Logical CPUs reserved for each rank actor (its placement bundle)."))
    temp_dir: str | None = setting(None, help=(
        "Root temp dir of the embedded cluster; keep it short (Ray puts unix sockets under it, "
        "and socket paths are limited to ~107 bytes). None = Ray's default."))
    runtime_env: dict | None = setting(None, help=(
        "Ray runtime_env applied to the job (env_vars, working_dir, pip, ...)."))
    log_to_driver: bool = setting(True, help="Stream the actors' stdout/stderr to the driver.")

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


class Transfer(Choice):
    """How rank traces reach the actors."""

    path = "path"  # actors read the files themselves (shared filesystem)
    object_store = "object_store"  # the driver ships the bytes through Ray's object store


class Executor(Choice):
    """Where independent work runs side by side (a mesh job's roles, a fit search's axes)."""

    local = "local"  # spawned worker processes on this machine
    ray = "ray"  # Ray tasks spread over a cluster's nodes


@dataclass
class TraceConfig:
    """Where the rank traces come from."""

    dir: str = setting(str(DEMO_TRACES / "gpt_dp_4"), help=(
        "A folder of rank traces, a .tar/.tar.gz archive of them, or one trace file. A trace's "
        "rank is the integer right before its .json suffix, after 'rank', '-', '_' or '.' "
        "(rank-3.et.json.gz, dlrm_eg_3.json); a lone trace without one is rank 0."))
    transfer: Transfer = setting(Transfer.path, help=(
        "path: actors read the files themselves (shared filesystem); object_store: the driver "
        "reads them once and ships the bytes through Ray's object store (no shared filesystem)."))
    group_map: dict[str, str] | None = setting(None, help=(
        "gloo traces do not name the group of a collective. When the traces hold several groups "
        "of different membership, map op kinds (or \"*\") to a pg_name, e.g. {\"*\": \"0\"}."))
    ranks: list[int] | None = setting(None, help=(
        "Trace ranks to replay, e.g. [0, 3]; null = every rank trace. A strict subset of the "
        "recorded world replays in replay.mode=compute only (collectives need every group "
        "member)."))
    max_decompressed_bytes: str = setting("4GiB", help=(
        "Refuse a gzip stream or an archive member that would expand past this size (bytes, or "
        "a size like \"16GiB\"): a gzip bomb costs at most this much memory."))
    parsed_cache_dir: str | None = setting(PARSED_CACHE_DIR, help=(
        "A trace of 32 MiB of JSON or more, once loaded, is kept here so its next load (the "
        "ranks after pre-flight, a sweep's points, the next run) reads it instead of parsing "
        "it; keyed by the file, its size and mtime, and the loader's code. null: no cache."))

    def __post_init__(self):
        self.transfer = Transfer.coerce(self.transfer, "trace.transfer")
        self.decompression_limit_bytes()  # a malformed size fails at compose time

    def decompression_limit_bytes(self) -> int:
        """``max_decompressed_bytes`` in bytes (ConfigError if malformed or not positive)."""
        limit = parse_bytes(self.max_decompressed_bytes, "trace.max_decompressed_bytes")
        if limit <= 0:
            raise ConfigError(f"trace.max_decompressed_bytes={self.max_decompressed_bytes!r}; "
                              "expected a positive size")
        return limit


class Search(Choice):
    """What one run of ``tracefleet`` does."""

    none = "none"  # one replay
    # bisection over the device capacity (orchestrator/studies/min_memory.py)
    min_memory = "min_memory"
    # modes on a device, minimums, flushing, estimate (orchestrator/studies/oom_study.py)
    oom_study = "oom_study"


@dataclass
class ExperimentConfig:
    """Run-level settings."""

    name: str = setting("replay", help="A name for the run (shown in the summary).")
    world_size: int | None = setting(None, help=(
        "Ranks to run; null = the trace folder's world size. Fewer than the traces have is "
        "refused."))
    replay_timeout_s: float = setting(900.0, help=(
        "Bound on the whole replay (all iterations on every rank), seconds."))
    failure_grace_s: float = setting(10.0, help=(
        "After the first rank fails, seconds the others get to finish (they may be blocked in a "
        "collective with it) before they are aborted."))
    progress_interval_s: float = setting(10.0, help=(
        "Seconds between progress lines while ranks run."))
    search: Search = setting(Search.none, help=(
        "none: one replay. min_memory: bisect replay.device_memory_capacity to the smallest one "
        "at which the replay completes, per allocation mode (experiment.min_memory). oom_study: "
        "every mode on an emulated device, their minimums, a flush, DeepSpeed's estimate "
        "(experiment.oom_study)."))
    min_memory: MinMemoryConfig = setting(factory=MinMemoryConfig, help=(
        "The minimum-memory search (orchestrator/study_config.py)."))
    oom_study: OomStudyConfig = setting(factory=OomStudyConfig, help=(
        "The OOM study (orchestrator/study_config.py)."))
    resume: bool = setting(True, help=(
        "--multirun: skip the points already recorded in the sweep root's results table."))
    report: bool = setting(True, help=(
        "Write report.html (plots and tables) at the end of a run, a sweep or a search."))
    preflight_only: bool = setting(False, help=(
        "Run pre-flight only (no actors): write preflight.json and summary.json, then stop."))
    dedup_identical_ranks: bool = setting(True, help=(
        "replay.mode=compute: ranks with byte-identical traces replay once, each rank's row "
        "being its group's report marked replayed_as_rank (orchestrator/preflight/dedup.py). "
        "false: every rank replays (e.g. to see the run-to-run spread of compute times across "
        "actors)."))

    def __post_init__(self):
        self.search = Search.coerce(self.search, "experiment.search")


@dataclass
class RunConfig:
    """The root config of ``tracefleet``."""

    cluster: ClusterConfig = setting(factory=ClusterConfig, help=(
        "Where the rank actors run (conf/cluster/*.yaml)."))
    trace: TraceConfig = setting(factory=TraceConfig, help=(
        "The traces to replay (conf/trace/*.yaml)."))
    replay: ReplayConfig = setting(factory=ReplayConfig, help=(
        "What each rank replays and how (conf/replay/*.yaml)."))
    zero3: Zero3Config = setting(factory=Zero3Config, help=(
        "The ZeRO-3 emulation (conf/zero3/*.yaml)."))
    target: TargetConfig = setting(factory=TargetConfig, help=(
        "The CUDA device to predict reserved memory for (actors/replay/memory/target.py); none: "
        "no model."))
    experiment: ExperimentConfig = setting(factory=ExperimentConfig, help=(
        "Run-level settings and searches (conf/experiment/*.yaml)."))

    def validate(self) -> None:
        """Raise ConfigError on inconsistent values (before any cluster work)."""
        check_finite(self)
        self.replay.validate()
        self.target.validate()
        self.zero3.validate(self.replay.mode)
        self.cluster.validate()


# Choices of a group that are ConfigStore entries, not conf/ files: the help and the generated
# config docs list them beside conf/'s presets (without registering: that imports torch)
STORED_CHOICES = {"replay": ("dry_run",)}


def store_group_schemas() -> None:
    """Store each config group's schema (``<group>/schema``: the first line of its presets'
    defaults, the same dataclass under every command) and ``STORED_CHOICES`` in Hydra's
    ConfigStore. Every ``compose`` calls this, so composing a preset needs no registration
    first; a call finding them there returns at once (storing is ~0.9 s of OmegaConf)."""
    store = ConfigStore.instance()
    (stored_group, (stored,)), = STORED_CHOICES.items()
    if f"{stored}.yaml" in store.repo.get(stored_group, {}):  # stored last
        return
    from actors.capture.workloads.config import WorkloadConfig  # torch: only once composing
    from actors.replay.config import dry_run_config

    for group, schema in (("cluster", ClusterConfig), ("trace", TraceConfig),
                          ("replay", ReplayConfig), ("zero3", Zero3Config),
                          ("target", TargetConfig), ("experiment", ExperimentConfig),
                          ("workload", WorkloadConfig)):
        store.store(group=group, name="schema", node=schema)
    store.store(group=stored_group, name=stored, node=dry_run_config())  # last: the check above
