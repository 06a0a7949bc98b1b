"""Traces a study or a prediction captures for itself: a capture workload traced on meta or
fake into a cache folder, reused while the workload stays the same; and the model back from a
trace folder's ``meta.json`` (for estimates that need the ``nn.Module``).

A cached folder is named ``<label>-<hash>``, the hash of the workload's fields (its
``zero3_emulation`` aside: a replay setting; on a GPU target, the revision of what runs as the
GPU's kernels), the world size, the torch version, whether
every rank's file was written, and a custom entrypoint's file content. It is written under a
temporary name and renamed when the capture finished, so a killed capture never leaves a
folder that a later run would take for complete.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from actors.errors import ConfigError, TraceError
from actors.trace.meta_file import META_JSON, environment_changes, meta_path_of, read_meta
from actors.trace.meta_file import workload as meta_workload
from orchestrator.config import WORKLOAD_CONF_DIR, compose
from orchestrator.run.roles_config import RolesConfig

if TYPE_CHECKING:
    from orchestrator.run.capture import CaptureResult


def workload_config(preset: str, overrides: dict | None = None):
    """The ``WorkloadConfig`` of ``conf/workload/<preset>.yaml`` (composed by Hydra, its
    defaults list with it) with ``overrides`` (field -> value, applied to the typed config: no
    quoting) on top and ``device=meta`` (a study captures shapes only); ConfigError on an
    unknown preset or field."""
    path = WORKLOAD_CONF_DIR / f"{preset}.yaml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in WORKLOAD_CONF_DIR.glob("*.yaml")))
        raise ConfigError(f"experiment.oom_study.workload={preset!r}: no {path}; expected one "
                          f"of {known}")
    preset_cfg = compose(None, [f"+workload={preset}"]).workload
    try:
        merged = OmegaConf.merge(preset_cfg, OmegaConf.create(dict(overrides or {})),
                                 {"device": "meta"})
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        raise ConfigError(f"experiment.oom_study.workload_overrides={dict(overrides or {})!r} "
                          f"on conf/workload/{preset}.yaml: {e}".splitlines()[0]) from None


def cached_capture(preset: str, overrides: dict | None, world_size: int, cache_dir: str) -> Path:
    """The folder of ``world_size`` rank traces of the preset, captured on meta into
    ``cache_dir`` unless an earlier study did (returns the cached folder then)."""
    capture, _ = capture_cached(workload_config(preset, overrides), world_size, cache_dir, preset)
    return capture.folder


# Workload fields added after caches were first keyed, with the value that means "as before":
# a job leaving them there keeps its key (its cached capture stays valid); any other value is
# in the key.
_LATER_FIELDS = {"gpu_kernels": None, "compile": False, "head_dim": 0, "tie_embeddings": False,
                 "loss_chunks": 1, "reshard_after_forward": "default", "moe_dense_layers": 0,
                 "moe_score": "softmax", "moe_groups": 0, "moe_limited_groups": 0,
                 "mla_kv_lora_rank": 0, "mla_q_lora_rank": 0, "mla_rope_head_dim": 64,
                 "mla_v_head_dim": 0, "optimizer_in_backward": False,
                 "float8_recipe": "tensorwise", "float8_all_gather": None, "moe_every": 1,
                 "attention_chunk": 0, "nope_every": 0, "optimizer": "adamw",
                 "activation_offload": False}
# What a GPU target's capture runs as the GPU's kernels (actors/capture/fake/cuda_dispatch.py)
# grows; each growth bumps this so its cached captures are taken again, not reused stale. 2:
# torch.optim's default and the built-in recipes' AdamW as on the GPU (foreach, fused), and
# autocast as CUDA's (a region for cuda entered, CUDA's cast policy). 3: the fused attention
# kernels' backward with what CUDA's kernels hold (flash's workspace, the memory-efficient
# kernel's delta, the gradient copied only where their layout needs it), compiled
# FlexAttention as inductor lowers it for a GPU, a step's save_on_cpu copies named as host.
GPU_DISPATCH_REVISION = 3


def capture_key(workload, world_size: int, rank0_only: bool = False) -> str:
    """The cache key of a capture: a hash of what changes its traces (see the module doc)."""
    import torch

    fields = dataclasses.asdict(workload)
    fields.pop("zero3_emulation", None)
    if workload.parallelism.is_one_dim():  # keys of 1-D jobs stay what they were
        fields.pop("parallelism", None)
    for name, default in _LATER_FIELDS.items():  # so do keys of jobs that leave them unset
        if fields.get(name) == default:
            fields.pop(name, None)
    if workload.gpu_kernels:  # keys of CPU targets stay what they were
        fields["gpu_dispatch_revision"] = GPU_DISPATCH_REVISION
    entry = _entrypoint_file(workload.entrypoint) if workload.entrypoint else None
    text = json.dumps({"workload": fields, "world_size": world_size,
                       "torch": torch.__version__, "rank0_only": rank0_only,
                       "entrypoint_sha1": hashlib.sha1(entry.read_bytes()).hexdigest()
                       if entry is not None else None}, sort_keys=True, default=str)
    return hashlib.sha1(text.encode()).hexdigest()[:10]


def _entrypoint_file(entrypoint: str) -> Path | None:
    """The file of a ``PATH.py:FUNCTION`` entrypoint (None for ``package.module:FUNCTION``)."""
    path = Path(entrypoint.rsplit(":", 1)[0])
    return path if path.suffix == ".py" and path.is_file() else None


def capture_cached(workload, world_size: int, cache_dir: str, label: str,
                   rank0_only: bool = False, timeout_s: float | None = None,
                   timeout_key: str = "capture_timeout_s", stall_s: float | None = None,
                   stall_key: str = "capture_stall_s", roles: RolesConfig | None = None,
                   roles_key: str = "roles") -> tuple[CaptureResult, bool]:
    """``(capture, reused)``: the workload's traces (a ``WorkloadConfig`` on meta or fake) at
    ``world_size``, captured into ``cache_dir`` unless an earlier run did; the capture's folder
    and its meta.json (read once from a cached folder). ``rank0_only``
    writes rank 0's file alone (on meta and fake it is every rank's: actors/capture/
    meta_world.py), with ``meta.json`` naming the world size. ``timeout_s`` bounds the
    capture (None: the default ``capture_timeout_s``; ``timeout_key`` names the setting),
    ``stall_s`` its time at one place (``capture_stall_s``, named by ``stall_key``);
    ``roles`` says how a mesh job's roles are recorded (named by ``roles_key``): not part of
    the cache key, since the traces do not depend on it. A capture that fails or is stopped
    leaves no temporary folder behind."""
    # torch (the capture's modules): only once a study captures or reads a capture
    from orchestrator.run.capture import CaptureConfig, CaptureResult, run_capture_job

    root = Path(os.path.expanduser(cache_dir))
    key = capture_key(workload, world_size, rank0_only)
    # a name, never a path: a preset named by a path (workload=../workload/gpt) stays in root
    label = re.sub(r"[^\w.-]", "_", label).lstrip(".") or "capture"
    # the label only names the folder: the same capture under another label is reused, when
    # the environment variables the user's code read then still have their values
    read: set[str] = set()
    for done in sorted(root.glob(f"*-{key}")) + sorted(root.glob(f"*-{key}-env*")):
        found = _cached_meta(done)
        if found is None:  # not a finished capture, or not one of ours
            continue
        meta, changed = found
        if not changed:
            return CaptureResult(done, meta), True
        read.update(meta["environment"])
    # a capture for other values of those variables lives beside, named by them
    values = json.dumps({name: os.environ.get(name) for name in sorted(read)}).encode()
    folder = root / (f"{label}-{key}" if not read else
                     f"{label}-{key}-env{hashlib.sha1(values).hexdigest()[:8]}")
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{folder.name}.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    bound = {} if timeout_s is None else {"capture_timeout_s": timeout_s}
    bound |= {} if stall_s is None else {"capture_stall_s": stall_s}
    bound |= {} if roles is None else {"roles": roles}
    try:
        captured = run_capture_job(
            CaptureConfig(workload=workload, world_size=world_size, out_dir=str(tmp),
                          overwrite=True, **bound), rank0_only=rank0_only,
            timeout_key=timeout_key, stall_key=stall_key, roles_key=roles_key)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        os.replace(tmp, folder)
    except OSError:  # another run captured the same workload meanwhile: theirs is complete
        shutil.rmtree(tmp, ignore_errors=True)
        return CaptureResult(folder, read_meta(folder / META_JSON)), False
    return dataclasses.replace(captured, folder=folder), False


def _cached_meta(folder: Path) -> tuple[dict, list[str]] | None:
    """A cached capture's meta.json and the variables its user code read whose values changed
    since (``environment_changes``); None for a folder without a well-formed meta.json."""
    try:
        meta = read_meta(folder / META_JSON)
        return None if meta is None else (meta, environment_changes(folder / META_JSON, meta))
    except TraceError:
        return None


def traced_model(trace_dir):
    """``(model on meta, world size)`` of a folder ``tracefleet-capture`` wrote (its
    ``meta.json`` names the workload); None when the folder has no such ``meta.json``."""
    meta_path = meta_path_of(trace_dir)
    meta = read_meta(meta_path)
    if meta is None:
        return None
    fields, world_size = meta_workload(meta_path, meta)
    import torch

    from actors.capture.workloads.build import WorkloadConfig, build_model

    known = {f.name for f in dataclasses.fields(WorkloadConfig)}
    cfg = WorkloadConfig(**{k: v for k, v in fields.items() if k in known})
    with torch.device("meta"):
        model, _ = build_model(cfg)
    return model, world_size
