"""Every schema the three commands compose with, registered in Hydra's ConfigStore at once.

The root schemas are one per command (``run_schema``: tracefleet's RunConfig,
``capture_schema``: tracefleet-capture's CaptureConfig, ``predict_schema``: tracefleet-predict's
PredictConfig) and ``fit_search_schema`` (tracefleet-predict's experiment=fit_search, named by
conf/experiment/fit_search.yaml). A group's schema (``<group>/schema``, the first line of its
presets' defaults) is the same dataclass under every command that composes the group, so each
is registered once. ``replay=dry_run`` is a choice registered here, not a conf/replay/ file.
"""
from __future__ import annotations

from hydra.core.config_store import ConfigStore

# replay=dry_run (actors/replay/config.py's dry_run_config): the help lists it beside conf/'s
# files without registering anything (registering imports torch, seconds a help must not cost)
STORED_CHOICES = {"replay": ("dry_run",)}


def register_all() -> None:
    """Register every root schema and group schema in Hydra's ConfigStore; a call finding them
    there returns at once (storing them is ~0.9 s of OmegaConf, and every compose calls this)."""
    (stored_group, (stored,)), = STORED_CHOICES.items()
    if f"{stored}.yaml" in ConfigStore.instance().repo.get(stored_group, {}):  # stored last
        return
    # torch (the workload's and the predictor's dataclasses): only once a command composes
    from actors.capture.workloads.config import WorkloadConfig
    from actors.replay.config import ReplayConfig, dry_run_config
    from actors.replay.memory.target import TargetConfig
    from actors.zero3.config import Zero3Config
    from orchestrator.config import ClusterConfig, ExperimentConfig, RunConfig, TraceConfig
    from orchestrator.run.capture import CaptureConfig
    from orchestrator.studies.fit_search_config import SCHEMA_NAME, FitSearchRunConfig
    from orchestrator.studies.predict import PredictConfig

    cs = ConfigStore.instance()
    for name, root in (("run_schema", RunConfig), ("capture_schema", CaptureConfig),
                       ("predict_schema", PredictConfig), (SCHEMA_NAME, FitSearchRunConfig)):
        cs.store(name=name, node=root)
    for group, schema in (("cluster", ClusterConfig), ("trace", TraceConfig),
                          ("replay", ReplayConfig), ("zero3", Zero3Config),
                          ("target", TargetConfig), ("experiment", ExperimentConfig),
                          ("workload", WorkloadConfig)):
        cs.store(group=group, name="schema", node=schema)
    cs.store(group=stored_group, name=stored, node=dry_run_config())  # last: the check above
