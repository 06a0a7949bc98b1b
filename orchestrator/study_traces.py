"""Traces a study captures for itself: a capture workload preset traced on the meta device into
a cache folder, reused while the workload stays the same; and the model back from a trace
folder's ``meta.json`` (for estimates that need the ``nn.Module``).

A cached folder is named ``<preset>-<hash of the workload's fields and world size>``; it is
written under a temporary name and renamed when the capture finished, so a killed capture
never leaves a folder that a later study would take for complete.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from pathlib import Path

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from actors.errors import ConfigError
from actors.trace.meta_file import META_JSON, meta_path_of, read_meta
from actors.trace.meta_file import workload as meta_workload

WORKLOAD_CONF_DIR = Path(__file__).resolve().parents[1] / "conf" / "workload"


def workload_config(preset: str, overrides: dict | None = None):
    """The ``WorkloadConfig`` of ``conf/workload/<preset>.yaml`` with ``overrides`` (field ->
    value) on top and ``device=meta`` (a study captures shapes only); ConfigError on an unknown
    preset or field."""
    from actors.capture.workloads import WorkloadConfig  # torch: only when a study captures

    path = WORKLOAD_CONF_DIR / f"{preset}.yaml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in WORKLOAD_CONF_DIR.glob("*.yaml")))
        raise ConfigError(f"experiment.oom_study.workload={preset!r}: no {path}; expected one "
                          f"of {known}")
    preset_cfg = OmegaConf.load(path)
    preset_cfg.pop("defaults", None)  # the Hydra schema line; the dataclass is the schema here
    try:
        merged = OmegaConf.merge(OmegaConf.structured(WorkloadConfig), preset_cfg,
                                 OmegaConf.create(dict(overrides or {})), {"device": "meta"})
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        raise ConfigError(f"experiment.oom_study.workload_overrides={dict(overrides or {})!r} "
                          f"on conf/workload/{preset}.yaml: {e}".splitlines()[0]) from None


def cached_capture(preset: str, overrides: dict | None, world_size: int, cache_dir: str) -> Path:
    """The folder of ``world_size`` rank traces of the workload, captured on meta into
    ``cache_dir`` unless an earlier study did (returns the cached folder then)."""
    from orchestrator.capture_main import CaptureConfig, run_capture_job

    workload = workload_config(preset, overrides)
    fields = json.dumps({"workload": dataclasses.asdict(workload), "world_size": world_size},
                        sort_keys=True, default=str)
    root = Path(os.path.expanduser(cache_dir))
    folder = root / f"{preset}-{hashlib.sha1(fields.encode()).hexdigest()[:10]}"
    if (folder / META_JSON).is_file():
        return folder
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{folder.name}.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    run_capture_job(CaptureConfig(workload=workload, world_size=world_size, out_dir=str(tmp),
                                  overwrite=True))
    try:
        os.replace(tmp, folder)
    except OSError:  # another study captured the same workload meanwhile: theirs is complete
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def traced_model(trace_dir):
    """``(model on meta, world size)`` of a folder ``tracefleet-capture`` wrote (its
    ``meta.json`` names the workload); None when the folder has no such ``meta.json``."""
    meta_path = meta_path_of(trace_dir)
    meta = read_meta(meta_path)
    if meta is None:
        return None
    fields, world_size = meta_workload(meta_path, meta)
    import torch

    from actors.capture.workloads import WorkloadConfig, build_model

    known = {f.name for f in dataclasses.fields(WorkloadConfig)}
    cfg = WorkloadConfig(**{k: v for k, v in fields.items() if k in known})
    with torch.device("meta"):
        model, _ = build_model(cfg)
    return model, world_size
