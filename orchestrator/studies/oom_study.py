"""``experiment=oom_study`` (``experiment.search=oom_study``): does a model fit a device, in which
allocation mode, what a flush threshold buys, and what the field's estimator says.

On one ``ReplaySession`` (one Ray cluster, one set of rank actors, traces loaded once):

1. Traces: ``trace.dir``, or with ``experiment.oom_study.workload`` a capture workload preset
   traced on meta into a cache folder (orchestrator/studies/study_traces.py).
2. Device: one replay per allocation mode at ``device_memory_capacity``, no flushing
   (``study`` rows, ``study_part=device``).
3. Minimum capacity per mode: ``experiment.min_memory``'s search (``probe`` and ``min_memory``
   rows; its tolerance and step bound apply).
4. Flushing: ``flush_mode`` at ``flush_capacity`` without a threshold, then with each of
   ``flush_thresholds`` (``study_part=flush``). A null ``flush_capacity`` is that mode's
   minimum capacity with the first flush threshold (one more search): it completes there,
   and when flushing buys anything it is below the minimum without one, hence OOM.
5. Estimate: DeepSpeed's ZeRO-3 model-state figures for the traced model, when the trace
   folder's ``meta.json`` names it (``estimate`` rows, orchestrator/studies/zero3_estimate.py).

Every row lands in the run dir's results table; orchestrator/reports/oom_study_table.py turns them
into the compact table printed on the console (markdown) and shown in the report.
"""
from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from actors.errors import ConfigError
from actors.replay.config import AllocationMode, parse_bytes
from orchestrator.results import ResultsStore, make_row, point_key, summary_columns
from orchestrator.units import human_bytes

log = logging.getLogger("tracefleet")

STUDY, ESTIMATE = "study", "estimate"  # row kinds (besides min_memory's probe / min_memory)
DEVICE, FLUSH = "device", "flush"  # study_part of a study row
MODE, THRESHOLD = "replay.allocation.mode", "replay.allocation.device_memory_threshold"
CAPACITY = "replay.device_memory_capacity"
_RESULT_STATUSES = ("ok", "oom")  # a replay that ends otherwise means the study is broken


@dataclass
class OomStudyConfig:
    """The OOM study (``experiment.search=oom_study``)."""

    # A capture workload preset (conf/workload/<name>.yaml, e.g. llama_70b) traced on the meta
    # device for the study, replacing trace.dir; null: study trace.dir as it is.
    workload: str | None = None
    # Workload fields over the preset's, e.g. {parallel: local, seq_len: 2048}.
    workload_overrides: dict[str, Any] = field(default_factory=dict)
    # Ranks captured. parallel=local workloads give every rank the same trace: 1 rank with
    # zero3.world_size=N replays rank 0 of an N-rank ZeRO-3 job.
    capture_world_size: int = 1
    # Captured traces are kept here, one folder per workload, and reused by later studies.
    trace_cache_dir: str = "~/.cache/tracefleet/traces"
    # The emulated device every mode is replayed on first, e.g. "80GiB".
    device_memory_capacity: str = "80GiB"
    # Allocation modes replayed on the device and searched for their minimum capacity.
    allocation_modes: list[AllocationMode] = field(
        default_factory=lambda: [AllocationMode.pre_allocate, AllocationMode.faithful,
                                 AllocationMode.lazy])
    # The flush demonstration: this mode at flush_capacity, without a threshold and with each
    # of flush_thresholds. null flush_capacity: flush_mode's minimum capacity with the first
    # of flush_thresholds (searched).
    flush_mode: AllocationMode = AllocationMode.lazy
    flush_thresholds: list[float] = field(default_factory=lambda: [0.5])
    flush_capacity: str | None = None
    # GPUs per node for DeepSpeed's estimate (nodes = world size / this; the world size is
    # zero3.world_size when set, else the trace's).
    gpus_per_node: int = 8

    def __post_init__(self):
        self.flush_mode = AllocationMode.coerce(self.flush_mode, "experiment.oom_study.flush_mode")
        self.allocation_modes = [AllocationMode.coerce(m, "experiment.oom_study.allocation_modes")
                                 for m in self.allocation_modes]

    def validate(self) -> None:
        """Raise ConfigError on values outside their domain or inconsistent with each other."""
        key = "experiment.oom_study"
        if not self.allocation_modes:
            raise ConfigError(f"{key}.allocation_modes is empty; expected at least one mode")
        if self.flush_mode == AllocationMode.pre_allocate:
            raise ConfigError(f"{key}.flush_mode=pre_allocate never flushes; expected lazy or "
                              "faithful")
        bad = [t for t in self.flush_thresholds if not 0 < t < 1]
        if not self.flush_thresholds or bad:
            raise ConfigError(f"{key}.flush_thresholds={list(self.flush_thresholds)}; expected "
                              "one or more fractions in (0, 1)")
        for name in ("device_memory_capacity", "flush_capacity"):
            value = getattr(self, name)
            if value is not None and parse_bytes(value, f"{key}.{name}") <= 0:
                raise ConfigError(f"{key}.{name}={value!r}; expected a positive size")
        if self.capture_world_size < 1 or self.gpus_per_node < 1:
            raise ConfigError(f"{key}.capture_world_size={self.capture_world_size}, "
                              f"gpus_per_node={self.gpus_per_node}; expected >= 1")


class _Study:
    """The study's replays, through ``replay(cfg, out_dir) -> summary``, and its rows."""

    def __init__(self, cfg, out_dir: Path, replay: Callable):
        self.cfg, self.out_dir, self.replay = cfg, Path(out_dir), replay
        self.store = ResultsStore(out_dir)

    def probe(self, part: str, mode: str, threshold: float, capacity: int) -> dict:
        cfg = copy.deepcopy(self.cfg)
        cfg.replay.allocation.mode = AllocationMode(mode)
        cfg.replay.allocation.device_memory_threshold = threshold
        cfg.replay.device_memory_capacity = str(capacity)
        run_dir = self.out_dir / STUDY / f"{part}-{mode}-t{threshold:g}-{capacity}"
        summary = self.replay(cfg, run_dir)
        overrides = [f"{MODE}={mode}", f"{THRESHOLD}={threshold}", f"{CAPACITY}={capacity}"]
        oom = summary.get("oom") or {}
        row = make_row(STUDY, f"{STUDY} {part} " + point_key(overrides), overrides,
                       summary["status"], summary.get("error"),
                       str(run_dir.relative_to(self.out_dir)), summary_columns(summary),
                       study_part=part, oom_node_id=oom.get("node_id"), oom_op=oom.get("op"),
                       oom_requested_bytes=oom.get("requested_bytes"))
        self.store.put(row)
        log.info("oom_study %s: %s threshold %g at %s -> %s", part, mode, threshold,
                 human_bytes(capacity), summary["status"])
        return row

    def estimates(self) -> list[dict]:
        from orchestrator.studies.study_traces import traced_model
        from orchestrator.studies.zero3_estimate import zero3_estimates

        traced = traced_model(self.cfg.trace.dir)
        if traced is None:
            log.info("oom_study: %s has no tracefleet-capture meta.json: no estimate rows",
                     self.cfg.trace.dir)
            return []
        model, trace_world = traced
        world = self.cfg.zero3.world_size if self.cfg.zero3.enabled and \
            self.cfg.zero3.world_size else trace_world
        rows = []
        for est in zero3_estimates(model, world, self.cfg.experiment.oom_study.gpus_per_node):
            row = make_row(ESTIMATE, f"{ESTIMATE} {est['options']}", [], "ok", None, None,
                           {"world_size": world}, **est)
            self.store.put(row)
            rows.append(row)
        return rows


def study(cfg, out_dir: Path, replay: Callable) -> dict:
    """Run the study of ``cfg`` (a RunConfig whose trace.dir holds the traces), each replay
    through ``replay(cfg, out_dir) -> summary``; rows go to ``out_dir``'s results table.
    Returns ``status`` (ok when every replay ended ok or oom and every search found its
    answer), ``error``, ``findings`` and ``rows`` (the study's own and the answers)."""
    osc = cfg.experiment.oom_study
    osc.validate()
    run = _Study(cfg, out_dir, replay)
    device = parse_bytes(osc.device_memory_capacity)
    modes = [str(m) for m in dict.fromkeys(osc.allocation_modes)]
    rows = [run.probe(DEVICE, m, 1.0, device) for m in modes]
    searches = [_search(cfg, out_dir, replay, modes, 1.0)]
    flush_mode, thresholds = str(osc.flush_mode), list(dict.fromkeys(osc.flush_thresholds))
    if osc.flush_capacity is not None:
        flush_capacity = parse_bytes(osc.flush_capacity)
    else:  # the smallest capacity seen to complete with the first threshold: below the mode's
        # minimum without flushing (else flushing bought nothing), and known to complete
        searches.append(_search(cfg, out_dir, replay, [flush_mode], thresholds[0]))
        flush_capacity = searches[-1]["searches"][0]["min_capacity_bytes"]
    if flush_capacity is not None:
        rows += [run.probe(FLUSH, flush_mode, t, flush_capacity) for t in (1.0, *thresholds)]
    rows += run.estimates()
    errors = [f"{r[MODE]} threshold {r[THRESHOLD]:g} at {human_bytes(r[CAPACITY])}: "
              f"{r['status']} ({r['reason']})" for r in rows
              if r["kind"] == STUDY and r["status"] not in _RESULT_STATUSES]
    errors += [s["error"] for s in searches if s["error"]]
    answers = [a for s in searches for a in s["searches"]]
    return {"status": "failed" if errors else "ok", "error": "; ".join(errors) or None,
            "findings": findings(rows, device), "rows": rows + answers}


def _search(cfg, out_dir: Path, replay: Callable, modes: list[str], threshold: float) -> dict:
    """``experiment.min_memory``'s search over ``modes`` at one flush threshold."""
    from orchestrator.studies.min_memory import search

    cfg = copy.deepcopy(cfg)
    cfg.experiment.min_memory.allocation_modes = [AllocationMode(m) for m in modes]
    cfg.experiment.min_memory.thresholds = [threshold]
    return search(cfg, out_dir, replay)


def findings(rows: list[dict], device: int) -> dict:
    """What the study shows: each mode's status on the device, and whether a flush threshold
    completed where the same mode without one was OOM (None when not replayed)."""
    on_device = {r[MODE]: r["status"] for r in rows
                 if r["kind"] == STUDY and r["study_part"] == DEVICE}
    flush = [r for r in rows if r["kind"] == STUDY and r["study_part"] == FLUSH]
    rescued = None
    if flush:
        rescued = flush[0]["status"] == "oom" and any(r["status"] == "ok" for r in flush[1:])
    return {"device_memory_capacity_bytes": device, "status_on_device": on_device,
            "flush_keeps_running": rescued}


def run_oom_study(cfg, out_dir: Path, config_yaml: str | None, session=None) -> dict:
    """``tracefleet experiment=oom_study``: traces captured when asked, the study on one
    ``ReplaySession``, rows and ``report.html`` in ``out_dir``; prints the table and returns
    the study's summary."""
    from orchestrator.run.launch import quiet_replays
    from orchestrator.reports.oom_study_table import markdown, study_table

    osc = cfg.experiment.oom_study
    osc.validate()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if osc.workload is not None:
        from orchestrator.studies.study_traces import cached_capture
        cfg.trace.dir = str(cached_capture(osc.workload, osc.workload_overrides,
                                           osc.capture_world_size, osc.trace_cache_dir))
        log.info("oom_study: traces of workload %s in %s", osc.workload, cfg.trace.dir)
        if config_yaml is not None:  # the config as studied: trace.dir is the captured folder
            from omegaconf import OmegaConf
            config_yaml = OmegaConf.to_yaml(OmegaConf.structured(cfg))
    if config_yaml is not None:
        (out_dir / "config.yaml").write_text(config_yaml)
    with quiet_replays(session) as replay:
        summary = study(cfg, out_dir, replay)
    print(markdown(study_table(summary["rows"])))
    f = summary["findings"]
    print(f"on {human_bytes(f['device_memory_capacity_bytes'])}: " + ", ".join(
        f"{mode} {status}" for mode, status in f["status_on_device"].items())
        + ("" if f["flush_keeps_running"] is None else
           f"; a flush threshold keeps {osc.flush_mode} running where it is OOM without: "
           f"{'yes' if f['flush_keeps_running'] else 'no'}"))
    if summary["error"]:
        print(f"oom_study: {summary['error']}")
    if cfg.experiment.report:
        from orchestrator.reports.html_report import write_report
        print(f"report: {write_report(out_dir)}")
    return summary
