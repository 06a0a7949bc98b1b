"""Every schema the three commands compose with, registered in Hydra's ConfigStore at once.

The root schemas are one per command (``run_schema``: tracefleet's RunConfig,
``capture_schema``: tracefleet-capture's CaptureConfig, ``predict_schema``: tracefleet-predict's
PredictConfig) and ``fit_search_schema`` (tracefleet-predict's experiment=fit_search, named by
conf/experiment/fit_search.yaml). The group schemas (``<group>/schema``, the first line of
their presets' defaults) and ``replay=dry_run`` are orchestrator/config.py's
``store_group_schemas``, which every compose calls too.
"""
from __future__ import annotations

from hydra.core.config_store import ConfigStore

from orchestrator.config import RunConfig, store_group_schemas

_ROOT_STORED_LAST = "fit_search_schema.yaml"


def register_all() -> None:
    """Register every root schema and group schema in Hydra's ConfigStore; a call finding them
    there returns at once (storing them is ~0.9 s of OmegaConf)."""
    store_group_schemas()
    if _ROOT_STORED_LAST in ConfigStore.instance().repo:
        return
    # torch (the capture's and the predictor's dataclasses): only once a command composes
    from orchestrator.run.capture import CaptureConfig
    from orchestrator.studies.fit_search_config import SCHEMA_NAME, FitSearchRunConfig
    from orchestrator.studies.predict import PredictConfig

    assert f"{SCHEMA_NAME}.yaml" == _ROOT_STORED_LAST
    cs = ConfigStore.instance()
    for name, root in (("run_schema", RunConfig), ("capture_schema", CaptureConfig),
                       ("predict_schema", PredictConfig), (SCHEMA_NAME, FitSearchRunConfig)):
        cs.store(name=name, node=root)  # fit_search_schema last: the check above
