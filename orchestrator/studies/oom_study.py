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
from pathlib import Path
from typing import Callable

from actors.replay.config import AllocationMode, parse_bytes
from orchestrator.results import CAPACITY, KIND, MIN_CAPACITY, MODE, REASON, STATUS, STUDY_PART, \
    THRESHOLD, ResultsStore, RowKind, StudyPart, make_row, point_key, summary_columns
from orchestrator.outputs import CONFIG_YAML
from orchestrator.status import ANSWERED, RunStatus
from orchestrator.units import human_bytes
from orchestrator.studies.min_memory import search
from orchestrator.run.launch import quiet_replays
from orchestrator.reports.oom_study_table import markdown, study_table
from orchestrator.studies.study_traces import cached_capture, traced_model
from orchestrator.reports.html_report import write_report
from orchestrator.studies.zero3_estimate import zero3_estimates

log = logging.getLogger("tracefleet")


class _Study:
    """The study's replays, through ``replay(cfg, out_dir) -> summary``, and its rows."""

    def __init__(self, cfg, out_dir: Path, replay: Callable):
        self.cfg, self.out_dir, self.replay = cfg, Path(out_dir), replay
        self.store = ResultsStore(out_dir)

    def probe(self, part: StudyPart, mode: str, threshold: float, capacity: int) -> dict:
        cfg = copy.deepcopy(self.cfg)
        cfg.replay.allocation.mode = AllocationMode(mode)
        cfg.replay.allocation.device_memory_threshold = threshold
        cfg.replay.device_memory_capacity = str(capacity)
        run_dir = self.out_dir / RowKind.study.value / f"{part}-{mode}-t{threshold:g}-{capacity}"
        summary = self.replay(cfg, run_dir)
        overrides = [f"{MODE}={mode}", f"{THRESHOLD}={threshold}", f"{CAPACITY}={capacity}"]
        oom = summary.get("oom") or {}
        row = make_row(RowKind.study, f"{RowKind.study} {part} " + point_key(overrides),
                       overrides, summary[STATUS], summary.get("error"),
                       str(run_dir.relative_to(self.out_dir)), summary_columns(summary),
                       **{STUDY_PART: StudyPart(part).value}, oom_node_id=oom.get("node_id"),
                       oom_op=oom.get("op"),
                       oom_requested_bytes=oom.get("requested_bytes"))
        self.store.put(row)
        log.info("oom_study %s: %s threshold %g at %s -> %s", part, mode, threshold,
                 human_bytes(capacity), summary[STATUS])
        return row

    def estimates(self) -> list[dict]:
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
            row = make_row(RowKind.estimate, f"{RowKind.estimate} {est['options']}", [],
                           RunStatus.ok, None, None,
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
    rows = [run.probe(StudyPart.device, m, 1.0, device) for m in modes]
    searches = [_search(cfg, out_dir, replay, modes, 1.0)]
    flush_mode, thresholds = str(osc.flush_mode), list(dict.fromkeys(osc.flush_thresholds))
    if osc.flush_capacity is not None:
        flush_capacity = parse_bytes(osc.flush_capacity)
    else:  # the smallest capacity seen to complete with the first threshold: below the mode's
        # minimum without flushing (else flushing bought nothing), and known to complete
        searches.append(_search(cfg, out_dir, replay, [flush_mode], thresholds[0]))
        flush_capacity = searches[-1]["searches"][0][MIN_CAPACITY]
    if flush_capacity is not None:
        rows += [run.probe(StudyPart.flush, flush_mode, t, flush_capacity)
                 for t in (1.0, *thresholds)]
    rows += run.estimates()
    errors = [f"{r[MODE]} threshold {r[THRESHOLD]:g} at {human_bytes(r[CAPACITY])}: "
              f"{r[STATUS]} ({r[REASON]})" for r in rows
              if r[KIND] == RowKind.study and r[STATUS] not in ANSWERED]
    errors += [s["error"] for s in searches if s["error"]]
    answers = [a for s in searches for a in s["searches"]]
    return {"status": RunStatus.failed if errors else RunStatus.ok,
            "error": "; ".join(errors) or None,
            "findings": findings(rows, device), "rows": rows + answers}


def _search(cfg, out_dir: Path, replay: Callable, modes: list[str], threshold: float) -> dict:
    """``experiment.min_memory``'s search over ``modes`` at one flush threshold."""
    cfg = copy.deepcopy(cfg)
    cfg.experiment.min_memory.allocation_modes = [AllocationMode(m) for m in modes]
    cfg.experiment.min_memory.thresholds = [threshold]
    return search(cfg, out_dir, replay)


def findings(rows: list[dict], device: int) -> dict:
    """What the study shows: each mode's status on the device, and whether a flush threshold
    completed where the same mode without one was OOM (None when not replayed)."""
    on_device = {r[MODE]: r[STATUS] for r in rows
                 if r[KIND] == RowKind.study and r[STUDY_PART] == StudyPart.device}
    flush = [r for r in rows if r[KIND] == RowKind.study and r[STUDY_PART] == StudyPart.flush]
    rescued = None
    if flush:
        rescued = flush[0][STATUS] == RunStatus.oom and any(r[STATUS] == RunStatus.ok
                                                            for r in flush[1:])
    return {"device_memory_capacity_bytes": device, "status_on_device": on_device,
            "flush_keeps_running": rescued}


def run_oom_study(cfg, out_dir: Path, config_yaml: str | None, session=None) -> dict:
    """``tracefleet experiment=oom_study``: traces captured when asked, the study on one
    ``ReplaySession``, rows and ``report.html`` in ``out_dir``; prints the table and returns
    the study's summary."""
    osc = cfg.experiment.oom_study
    osc.validate()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if osc.workload is not None:
        cfg.trace.dir = str(cached_capture(osc.workload, osc.workload_overrides,
                                           osc.capture_world_size, osc.trace_cache_dir))
        log.info("oom_study: traces of workload %s in %s", osc.workload, cfg.trace.dir)
        if config_yaml is not None:  # the config as studied: trace.dir is the captured folder
            from omegaconf import OmegaConf
            config_yaml = OmegaConf.to_yaml(OmegaConf.structured(cfg))
    if config_yaml is not None:
        (out_dir / CONFIG_YAML).write_text(config_yaml)
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
        print(f"report: {write_report(out_dir)}")
    return summary
