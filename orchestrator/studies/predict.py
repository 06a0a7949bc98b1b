"""``tracefleet-predict``'s work: does a training job fit a GPU? One answer from one command.

``predict(cfg)`` captures the workload on meta or fake (shapes only; cached by the config's
hash: orchestrator/studies/study_traces.py), dry-runs it in this process (no Ray: one replay per
distinct rank trace, orchestrator/run/dry_run.py) with faithful allocation, the target's
caching allocator model (actors/replay/memory/reserved_model.py) and, when the workload preset asks for it, the ZeRO-3
emulation at the job's world size. The verdict compares the predicted reserved peak with the
target's usable capacity: ``oom`` when it does not fit, ``too_close`` when the headroom is
inside the prediction's error band, ``fits`` otherwise.
"""
from __future__ import annotations

import copy
import dataclasses
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import orjson

from actors.config_fields import check_finite
from actors.capture.workloads.mesh import validate_parallelism
from actors.capture.workloads.config import (ModelName, Parallel, Precision, WorkloadConfig,
                                             WorkloadDevice, validate as validate_workload)
from actors.config_fields import setting
from actors.errors import ConfigError, writing
from actors.replay.config import AllocationMode, ReplayConfig, dry_run_config, parse_bytes
from actors.replay.memory.model_recording import TIMELINE_KEY, pop_snapshot
from actors.trace.parsed_cache import DEFAULT_DIR as PARSED_CACHE_DIR
from actors.gpu_arch import GpuArch
from actors.replay.memory.target import TargetConfig, TargetName
from actors.replay.report import RankFigures
from orchestrator.run.dry_run import dry_run
from orchestrator.reports.predict_timelines import per_role
from orchestrator.reports.predict_notes import breakdown_help
from orchestrator.studies.predict_mesh import kernel_dispatch, mesh_facts, ranks_per_trace
from actors.zero3.config import Zero3Config
from actors.capture.workloads.custom import resolve_entrypoint
from orchestrator.studies.study_traces import capture_cached
from actors.trace.meta_file import recorded_world_size
from actors.trace.source import discover, missing_ranks
from orchestrator.sinks import Sink, close_all, write_all
from orchestrator.studies.prediction import BREAKDOWN_OF, Prediction, Verdict
from orchestrator.studies.prediction_sinks import PredictionResult, prediction_sinks
from orchestrator.run.capture import CaptureResult, check_world_size
from orchestrator.config import Executor
from orchestrator.run.roles_config import RolesConfig

log = logging.getLogger("tracefleet")

# what FSDP2's CPUOffloadPolicy keeps in host memory (actors/trace/categories.py)
OFFLOADED = ("parameters", "gradients", "optimizer_state")
# bench_predict's target band, which every configuration is measured within (2026-12-01: max
# |error| 0.0125); wider than that maximum because the measured peak itself moves ~1% between
# identical runs and the GPU's allocator adds its own (the one source: conf/predict.yaml and the
# docs name this).
DEFAULT_ERROR_BAND = 0.03
DEFAULT_ERROR_BAND_SOURCE = ("bench_predict's target band (every row within it; max |error| "
                             "0.0125, 2026-12-01)")


@dataclass
class PredictTraceConfig:
    """A trace you already have, instead of capturing the workload."""

    dir: str | None = setting(None, help=(
        "A folder of rank traces, a .tar/.tar.gz archive of them, or one trace file (as "
        "tracefleet's trace.dir); null: capture the workload."))
    max_decompressed_bytes: str = setting("4GiB", help=(
        "Refuse a gzip stream or an archive member that would expand past this size."))
    parsed_cache_dir: str | None = setting(PARSED_CACHE_DIR, help=(
        "Where a large trace, once loaded, is kept for its next load (as tracefleet's "
        "trace.parsed_cache_dir; captures too). null: no cache."))


@dataclass
class PredictSettings:
    """How the verdict is drawn and where captures are kept."""

    error_band: float = setting(DEFAULT_ERROR_BAND, help=(
        "The prediction's relative error (0.03 = 3% of the predicted reserved peak): a headroom "
        "smaller than this is too_close. The default is DEFAULT_ERROR_BAND "
        "(orchestrator/studies/predict.py, with its source)."))
    error_band_source: str = setting(DEFAULT_ERROR_BAND_SOURCE, help=(
        "Where error_band's value comes from (printed beside it)."))
    cache_dir: str = setting("~/.cache/tracefleet/traces", help=(
        "Captures are kept here, one folder per workload config, world size and torch version."))
    snapshot: bool = setting(False, help=(
        "Also write snapshot_rank<r>.pickle per distinct rank trace: the caching allocator "
        "model's segments, blocks and history in torch.cuda.memory._snapshot()'s layout (open "
        "it at pytorch.org/memory_viz; compare it with a GPU's: tracefleet-compare)."))
    capture_timeout_s: float = setting(900.0, help=(
        "Bound on recording one rank (on meta or fake, in this process; a mesh job records "
        "one rank per role, each within it), seconds: a custom step that never returns is "
        "stopped with an error naming where it was."))
    capture_stall_s: float = setting(120.0, help=(
        "Stop a capture on meta or fake whose step stays at the very same place (every "
        "frame's line) this long, seconds, with an error naming the place, well before "
        "capture_timeout_s: a wait or a loop that never ends; 0: only the whole bound."))
    roles: RolesConfig = setting(factory=RolesConfig, help=(
        "A mesh job captured on fake: how many of its roles (one recorded rank each) are "
        "recorded at once, and where (orchestrator/run/roles.py)."))


@dataclass
class PredictConfig:
    """The root config of ``tracefleet-predict``."""

    workload: WorkloadConfig = setting(factory=WorkloadConfig, help=(
        "The training job (conf/workload/<preset>.yaml and workload.* overrides). Captured on "
        "meta where the recipe runs there, else on fake (fsdp2, bf16_mixed, custom)."))
    world_size: int | None = setting(None, help=(
        "The job's number of GPUs (ranks). null with trace.dir: the number of rank traces."))
    target: TargetConfig = setting(
        factory=lambda: TargetConfig(name=TargetName.h100_80gb), help=(
            "The GPU (conf/target/*.yaml); its usable capacity is what the reserved peak "
            "must fit."))
    trace: PredictTraceConfig = setting(factory=PredictTraceConfig, help=(
        "A trace you already have (trace.dir), instead of capturing the workload."))
    replay: ReplayConfig = setting(
        factory=lambda: dry_run_config(AllocationMode.faithful), help=(
            "The dry run: meta, operators only, faithful allocation (memory held as the "
            "original held it), one warm-up and one measured iteration."))
    zero3: Zero3Config = setting(factory=Zero3Config, help=(
        "With trace.dir: the ZeRO-3 emulation of plain (not sharded) traces at world_size ranks "
        "(conf/zero3/*.yaml, e.g. zero3=per_module); a workload preset carries its own instead "
        "(workload.zero3_emulation)."))
    predict: PredictSettings = setting(factory=PredictSettings, help=(
        "How the verdict is drawn and where captures are kept."))

    def validate(self) -> None:
        """ConfigError on values that cannot give a prediction (before any capture)."""
        check_finite(self)
        if not self.target.enabled:
            raise ConfigError("target=none: tracefleet-predict needs a GPU, e.g. target=h100_80gb "
                              "or target=custom target.device_memory=100GiB")
        self.target.validate()
        self.replay.validate()
        if self.replay.device != "meta":
            raise ConfigError(f"replay.device={self.replay.device}: tracefleet-predict dry-runs "
                              "on meta")
        if not 0 <= self.predict.error_band < 1:
            raise ConfigError(f"predict.error_band={self.predict.error_band}; expected a fraction "
                              "in [0, 1), e.g. 0.03 for 3%")
        if self.trace.dir is not None and not Path(self.trace.dir).exists():
            raise ConfigError(f"trace.dir={self.trace.dir} does not exist; expected a folder of "
                              "rank traces, a .tar[.gz] archive of them, or one trace file")
        if self.world_size is not None:
            check_world_size(self.world_size)  # refused before any capture
        if self.predict.capture_timeout_s <= 0:
            raise ConfigError(f"predict.capture_timeout_s={self.predict.capture_timeout_s:g}; "
                              "expected seconds > 0")
        self.predict.roles.validate("predict.roles")
        if self.predict.capture_stall_s < 0:
            raise ConfigError(f"predict.capture_stall_s={self.predict.capture_stall_s:g}; "
                              "expected seconds >= 0 (0: no stall bound)")
        if self.zero3.enabled and self.trace.dir is None:
            raise ConfigError(f"zero3={self.zero3.strategy} emulates ZeRO-3 on traces you give "
                              "with trace.dir; a workload takes workload.zero3_emulation."
                              f"strategy={self.zero3.strategy} instead")
        if self.trace.dir is None:
            if self.world_size is None:
                raise ConfigError("world_size=N is required: the job's number of GPUs")
            validate_workload(capture_workload(self.workload))
            validate_parallelism(self.workload, self.world_size)
        parse_bytes(self.trace.max_decompressed_bytes, "trace.max_decompressed_bytes")


def capture_workload(workload: WorkloadConfig, gpu_arch: GpuArch | None = None
                     ) -> WorkloadConfig:
    """The workload on a shapes-only device: meta where the recipe runs there, else fake
    (FSDP2 refuses meta parameters, autocast has no meta backend, a custom step may use either),
    dispatching as ``gpu_arch``'s kernels unless ``workload.gpu_kernels`` names others."""
    wl = copy.deepcopy(workload)
    wl.gpu_kernels = wl.gpu_kernels or gpu_arch
    needs_fake = wl.model == ModelName.custom or wl.parallel == Parallel.fsdp2 \
        or wl.precision == Precision.bf16_mixed
    if wl.device != WorkloadDevice.fake:
        wl.device = WorkloadDevice.fake if needs_fake else WorkloadDevice.meta
    if wl.model == ModelName.custom and wl.entrypoint:
        wl.entrypoint = resolve_entrypoint(wl.entrypoint)
    return wl


def _capture(cfg: PredictConfig, name: str) -> tuple[CaptureResult, dict]:
    """The cached (or new) capture of the workload; ``(capture, facts about it)``."""
    wl = capture_workload(cfg.workload, cfg.target.gpu_arch)
    # every rank of a local workload trains alone: its trace does not depend on the world
    world = 1 if wl.parallel == Parallel.local and wl.model != ModelName.custom else cfg.world_size
    start = time.perf_counter()
    captured, reused = capture_cached(wl, world, cfg.predict.cache_dir, name, rank0_only=True,
                                      timeout_s=cfg.predict.capture_timeout_s,
                                      timeout_key="predict.capture_timeout_s",
                                      stall_s=cfg.predict.capture_stall_s,
                                      stall_key="predict.capture_stall_s",
                                      roles=cfg.predict.roles, roles_key="predict.roles")
    folder = captured.folder
    took = time.perf_counter() - start
    if reused:
        log.info("predict: capture reused from the cache: %s", folder)
    else:
        log.info("predict: captured on %s in %.1f s into %s", wl.device, took, folder)
    return captured, {"dir": str(folder), "reused": reused, "device": str(wl.device),
                      "world_size": world, "seconds": took,
                      "gpu_kernels": str(wl.gpu_kernels) if wl.gpu_kernels else None}


def _given_traces(cfg: PredictConfig) -> tuple[dict, int, Zero3Config | None]:
    """``(rank -> source, world size, ZeRO-3 emulation or None)`` of ``trace.dir``. Without
    the emulation every rank's trace is needed; with it, one plain trace stands for every rank
    of the ``world_size``-rank job (each rank runs the same program on its own shard)."""
    sources = discover(cfg.trace.dir, parse_bytes(cfg.trace.max_decompressed_bytes),
                       cfg.trace.parsed_cache_dir)
    recorded = recorded_world_size(cfg.trace.dir)
    # A rank whose file is missing is named, never predicted as a smaller job: its world is
    # what meta.json records, else up to the highest rank found
    missing = missing_ranks(sources, recorded or max(sources) + 1)
    if missing and not (cfg.zero3.enabled and len(sources) == 1):
        said = f"meta.json records world_size {recorded}" if recorded else \
            f"it holds rank {max(sources)}"
        raise ConfigError(f"{cfg.trace.dir}: no trace of rank(s) {missing} ({said}; found "
                          f"ranks {sorted(sources)}); give every rank's trace file")
    world = cfg.world_size or len(sources)
    if world != len(sources) and not (cfg.zero3.enabled and len(sources) == 1):
        raise ConfigError(f"world_size={world} but {cfg.trace.dir} holds {len(sources)} rank "
                          "trace(s); leave world_size out or give every rank's trace (or one "
                          "plain trace with zero3=<strategy>)")
    if not cfg.zero3.enabled:
        return sources, world, None
    zero3 = dataclasses.replace(cfg.zero3, world_size=world)
    zero3.validate(str(cfg.replay.mode))
    return sources, world, zero3


def verdict(headroom_bytes: int, reserved_bytes: int, error_band: float,
            num_predicted_ooms: int) -> Verdict:
    """``oom`` below zero headroom (or when the model ran out), ``too_close`` within
    ``error_band`` x the reserved peak, else ``fits``."""
    if headroom_bytes < 0 or num_predicted_ooms:
        return Verdict.oom
    if headroom_bytes < error_band * reserved_bytes:
        return Verdict.too_close
    return Verdict.fits


def predict(cfg: PredictConfig, out_dir: Path | None = None, name: str | None = None,
            sinks: list[Sink[PredictionResult]] | None = None) -> Prediction:
    """The prediction for ``cfg``, handed to ``sinks`` (default: its files in ``out_dir`` when
    given, prediction_sinks.py; none without one); ``name`` labels the workload (its
    preset), default ``<model>_<parallel>``."""
    cfg = copy.deepcopy(cfg)
    cfg.validate()
    t0 = time.perf_counter()
    # what prediction.html plots, and the snapshots, are recorded only when written
    cfg.replay.allocator_timeline |= out_dir is not None
    cfg.replay.allocator_snapshot |= cfg.predict.snapshot and out_dir is not None
    name, sources, world, zero3, captured, capture = _sources(
        cfg, name or f"{cfg.workload.model}_{cfg.workload.parallel}")
    t1 = time.perf_counter()
    roles = cfg.predict.roles  # the recorded roles' traces dry-run as many at once, locally
    groups, reports = dry_run(sources, cfg.replay, cfg.target, zero3,
                              roles.num_workers if roles.executor == Executor.local else 1)
    replay_s = time.perf_counter() - t1
    snapshots = {rank: pop_snapshot(report) for rank, report in reports.items()}
    prediction = _prediction(cfg, name, reports, groups, sorted(sources), world, zero3,
                             captured, capture, replay_s, t0)
    if sinks is None:
        sinks = prediction_sinks() if out_dir is not None else []
    result = PredictionResult(prediction, reports, None if out_dir is None else Path(out_dir),
                              snapshots)
    _hand_to(sinks, result)
    return prediction


def _prediction(cfg: PredictConfig, name: str, reports: dict, groups: dict, ranks: list[int],
                world: int, zero3: Zero3Config | None, captured: CaptureResult | None,
                capture: dict | None, replay_s: float, t0: float) -> Prediction:
    """The prediction of the dry run's ``reports``: the figures of the rank with the largest
    reserved peak, the verdict, and what they rest on (``captured``'s meta.json, and
    ``capture`` the facts about it, of a captured workload)."""
    worst = max(reports.values(), key=lambda r: r["predicted_reserved_peak_bytes"])
    figures = worst["cuda_allocator"]["target"]
    reserved, usable = worst["predicted_reserved_peak_bytes"], figures["usable_capacity_bytes"]
    mesh = mesh_facts(captured.meta, worst["rank"]) if captured else None
    core = RankFigures.of(worst)  # what every replay reports; the allocator model's below
    return Prediction(
        predicted_allocated_peak_bytes=worst["predicted_allocated_peak_bytes"],
        predicted_reserved_peak_bytes=reserved, usable_capacity_bytes=usable,
        headroom_bytes=usable - reserved,
        verdict=str(verdict(usable - reserved, reserved, cfg.predict.error_band,
                            worst["num_predicted_ooms"])),
        error_band=cfg.predict.error_band, breakdown=core.peak_breakdown, peak_op=core.peak_op,
        world_size=world,
        workload={"name": name, **_plain(cfg.workload)} if cfg.trace.dir is None
        else {"name": name, "trace_dir": str(cfg.trace.dir)},
        error_band_source=cfg.predict.error_band_source,
        accounted_peak_bytes=core.accounted_peak_bytes, breakdown_of=BREAKDOWN_OF,
        breakdown_help=breakdown_help(core.peak_breakdown),
        num_predicted_ooms=worst["num_predicted_ooms"],
        num_alloc_retries=worst["num_alloc_retries"],
        host_peak_bytes=worst["cuda_allocator"].get("host_peak_bytes", 0),
        coverage=core.coverage, num_dropped_ops=core.num_dropped_ops,
        num_orphan_ops=core.num_orphan_ops, not_run_ops=core.not_run_ops, target=figures,
        zero3_emulation=_plain(zero3) if zero3 is not None else None, rank=worst["rank"],
        ranks=ranks, num_distinct_traces=len(groups),
        ranks_per_trace={str(r[0]): len(r) for r in groups.values()}
        if cfg.trace.dir is not None and len(ranks) == world
        else ranks_per_trace(captured.roles) if mesh else {"0": world},
        mesh=mesh, capture=capture,
        kernel_dispatch=kernel_dispatch(captured.meta) if captured else [],
        timings_s={"capture_s": capture["seconds"] if capture else 0.0, "replay_s": replay_s,
                   "total_s": time.perf_counter() - t0},
        memory_timeline=worst["cuda_allocator"].get(TIMELINE_KEY), snapshots={},
        per_role=per_role(reports, captured.roles if mesh else None, mesh))


def _sources(cfg: PredictConfig, name: str) -> tuple:
    """(name, the rank traces, world size, ZeRO-3 emulation or None, the capture and the facts
    about it, or None, None): the given traces (``trace.dir``), else the workload captured (or
    found cached)."""
    if cfg.trace.dir is not None:
        sources, world, zero3 = _given_traces(cfg)
        return "trace", sources, world, zero3, None, None
    if cfg.workload.cpu_offload:  # the offloaded states: host memory
        cfg.target.host_categories = list(OFFLOADED)
    if cfg.workload.activation_offload:  # the saved tensors' host copies
        cfg.target.host_categories = [*cfg.target.host_categories, "activations"]
    captured, capture = _capture(cfg, name)
    zero3 = None
    if cfg.workload.zero3_emulation.enabled:
        zero3 = dataclasses.replace(cfg.workload.zero3_emulation, world_size=cfg.world_size)
        zero3.validate(str(cfg.replay.mode))
    return name, discover(captured.folder, parsed_cache_dir=cfg.trace.parsed_cache_dir), \
        cfg.world_size, zero3, captured, capture


def _hand_to(sinks: list[Sink[PredictionResult]], result: PredictionResult) -> None:
    """Each sink's ``write``, then each one's ``close``; a write that fails in ``out_dir``
    (a full disk) names the folder."""
    if result.out_dir is None:
        write_all(sinks, result)
        close_all(sinks, result)
        return
    with writing(result.out_dir, "the prediction's files"):
        result.out_dir.mkdir(parents=True, exist_ok=True)
        write_all(sinks, result)
        close_all(sinks, result)


def _plain(obj) -> dict:
    """A config dataclass as JSON-ready values (choices as their strings)."""
    return orjson.loads(orjson.dumps(dataclasses.asdict(obj), default=str))
