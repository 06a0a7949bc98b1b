"""``tracefleet-predict experiment=fit_search``: the largest local batch, the longest sequence,
the fewest GPUs, the cheapest activation checkpointing and (when asked) the cheapest mesh
layout (orchestrator/studies/fit_layout.py) that still ``fits`` the target.

One axis at a time, the others at the composed job's values. Every probe is one prediction
(orchestrator/predict.py ``predict``: the capture on meta/fake cached by the config's hash, the
in-process dry run, the allocator model, the verdict with its error band); a value is accepted
only when its verdict is ``fits``, so the answer keeps the verdict's margin.

The integer axes and the GPU count are searched over a list of candidates ordered from the
safest to the most ambitious (batch and sequence ascending, GPU counts descending), assuming
that whatever fits, every safer candidate fits too: a gallop from the job's own value (index
``i`` -> ``2i + 1``: the value doubles for batch and sequence; downwards ``i`` ->
``(i - 1) // 2``), then bisection between the last candidate seen to fit and the first seen
not to, until the two ends' reserved peaks are within the verdict's error band of each other
(what lies between is a difference the prediction cannot resolve: probing it would only
spend probes inside the too_close zone). Activation checkpointing is walked from the cheapest
level up, no assumption made.

With ``fit_search.num_workers`` > 1 the axes are searched side by side in worker processes
(spawned: no torch state forked); the job's own prediction is made first, here, and handed to
them, and each probe is reported the moment its worker finishes it. With
``fit_search.executor=ray`` the axes are Ray tasks spread over the nodes of the cluster at
``fit_search.ray_address`` instead (orchestrator/cluster/ray_pool.py), the job's prediction
handed to them the same way: the memo is the same wherever an axis runs.
"""
from __future__ import annotations

import copy
import logging
import time
from dataclasses import fields
from pathlib import Path
from typing import Callable, Sequence

from actors.errors import ConfigError
from orchestrator.studies.fit_answer import AxisAnswer
from orchestrator.studies.fit_layout import search_layout, with_layout
from orchestrator.studies.fit_search_config import AC_ORDER, Axis, FitSearchRunConfig
from orchestrator.cluster.worker_pool import in_workers, tell_parent
from orchestrator.config import ClusterConfig, Executor
from orchestrator.studies.predict import PredictConfig, predict
from orchestrator.studies.prediction import Prediction
from orchestrator.studies.prediction_sinks import PredictionPage, prediction_sinks
from orchestrator.studies.fit_search_report import (ANSWER_COLUMNS, FitSearchRecorder, answer_rows,
                                                    answers_title)

log = logging.getLogger("tracefleet")


def gallop_bisect(values: Sequence, start: int, fits: Callable[[object], bool],
                  max_probes: int, indistinct: Callable[[int, int], bool] = lambda a, b: False
                  ) -> tuple[int | None, int | None, str | None]:
    """``(last index seen to fit, first index seen not to, reason)`` over ``values`` ordered
    safest first (assumed: whatever fits, every earlier value fits). Probes ``start`` first,
    then gallops and bisects (see the module doc); ``reason`` says why the pair is not adjacent
    (None when it is, or when an end of ``values`` was reached). Bisection stops early when
    ``indistinct(ok, fail)``: what lies between cannot be told apart (fit_search: their peaks
    are within the prediction's error band)."""
    ok = fail = None
    for _ in range(max_probes):
        if ok is not None and fail is not None and fail - ok > 1 and indistinct(ok, fail):
            return ok, fail, INDISTINCT
        if ok is None and fail is None:
            i = start
        elif fail is None:
            if ok == len(values) - 1:
                return ok, None, None
            i = min(2 * ok + 1, len(values) - 1)
        elif ok is None:
            if fail == 0:
                return None, 0, None
            i = (fail - 1) // 2
        elif fail - ok <= 1:
            return ok, fail, None
        else:
            i = (ok + fail) // 2
        if fits(values[i]):
            ok = i
        else:
            fail = i
    done = (ok is not None and fail is not None and fail - ok <= 1) or ok == len(values) - 1 \
        or fail == 0
    return ok, fail, None if done else f"stopped after fit_search.max_probes={max_probes}"


INDISTINCT = ("the values between have peaks within the error band of both ends: the "
              "prediction cannot tell them apart, so they were not probed")


class _Prober:
    """Predictions of the job with one field changed; one record per probe, reported through
    ``on_probe`` as it finishes. Every axis starts at the job's own values: that prediction
    is made once and its figures reused (``memoized``) by the other axes' first probe."""

    def __init__(self, cfg: FitSearchRunConfig, name: str, on_probe: Callable[[dict], None],
                 done: dict[tuple, Prediction] | None = None):
        self.cfg, self.name, self.on_probe = cfg, name, on_probe
        # (batch, seq, world size, AC) -> prediction
        self.done: dict[tuple, Prediction] = dict(done or {})
        # predictions made on this prober's behalf elsewhere (the job's, by the parent of a
        # worker): its first probe of them is not a reuse
        self.made_for_me: set[tuple] = set()

    def predict_job(self) -> None:
        """The job's own prediction, made once for every axis' first probe."""
        job = _job_key(self.cfg)
        if job not in self.done:
            try:
                self.done[job] = predict(_as_predict_config(self.cfg), name=self.name)
            except ConfigError as e:
                raise ConfigError(f"fit_search: the job itself: {e}") from None

    def fits(self, axis: Axis, value, probes: list[dict], label: str | None = None) -> bool:
        """Whether ``value`` on ``axis`` fits with the verdict's margin (recorded in ``probes``;
        ``label`` names the value there: a layout's degrees)."""
        cfg = copy.deepcopy(self.cfg)
        if axis == Axis.world_size:
            cfg.world_size = value
        elif axis == Axis.layout:
            cfg = with_layout(cfg, value)
        else:
            setattr(cfg.workload, str(axis), value)
        t0 = time.perf_counter()
        job = _job_key(cfg)
        memoized = job in self.done and job not in self.made_for_me
        self.made_for_me.discard(job)
        if job not in self.done:
            try:
                self.done[job] = predict(_as_predict_config(cfg), name=self.name)
            except ConfigError as e:
                raise ConfigError(f"fit_search {axis}={value}: {e}") from None
        p = self.done[job]
        record = {"axis": str(axis), "value": value if label is None else label,
                  "verdict": p.verdict,
                  "predicted_allocated_peak_bytes": p.predicted_allocated_peak_bytes,
                  "predicted_reserved_peak_bytes": p.predicted_reserved_peak_bytes,
                  "usable_capacity_bytes": p.usable_capacity_bytes,
                  "headroom_bytes": p.headroom_bytes, "error_band": p.error_band,
                  "capture_reused": bool(p.capture and p.capture["reused"]),
                  "probe_s": time.perf_counter() - t0, "num_probe": len(probes) + 1,
                  "memoized": memoized}
        probes.append(record)
        self.on_probe(record)
        return p.fits


def _job_key(cfg: FitSearchRunConfig) -> tuple:
    """What tells one probed job from another: (batch, seq, world size, AC, mesh)."""
    wl = cfg.workload
    par = wl.parallelism
    mesh = (par.dp_replicate, par.tp, par.pp, par.cp, par.ep, str(par.pp_schedule),
            par.pp_microbatches, par.pp_stages_per_rank)
    return wl.batch_size, wl.seq_len, cfg.world_size, str(wl.activation_checkpointing), mesh


def _as_predict_config(cfg: FitSearchRunConfig) -> PredictConfig:
    """The job as a plain PredictConfig (predict validates it; the search fields are not its)."""
    return PredictConfig(**{f.name: getattr(cfg, f.name) for f in fields(PredictConfig)})


def _candidates(cfg: FitSearchRunConfig, axis: Axis) -> tuple[Sequence, int]:
    """``(candidates safest first, index of the job's own value)`` of an integer axis."""
    fs, wl = cfg.fit_search, cfg.workload
    if axis == Axis.batch_size:
        values = range(1, fs.max_batch_size + 1)
        return values, min(wl.batch_size, fs.max_batch_size) - 1
    if axis == Axis.seq_len:
        step = fs.seq_len_step
        values = range(step, fs.max_seq_len // step * step + 1, step)
        return values, max(min(wl.seq_len // step, len(values)) - 1, 0)
    sizes = fs.candidate_world_sizes(cfg.world_size)[::-1]  # most GPUs (safest) first
    start = min(range(len(sizes)), key=lambda i: (abs(sizes[i] - cfg.world_size), i))
    return sizes, start


def search_axis(cfg: FitSearchRunConfig, axis: Axis, prober: _Prober) -> AxisAnswer:
    """One axis' search (see the module doc)."""
    probes: list[dict] = []
    max_probes = cfg.fit_search.max_probes
    if axis == Axis.layout:
        return search_layout(cfg, prober)
    if axis == Axis.activation_checkpointing:
        for level in AC_ORDER[:max_probes]:
            if prober.fits(axis, level, probes):
                failing = str(AC_ORDER[AC_ORDER.index(level) - 1]) if level != AC_ORDER[0] else None
                return AxisAnswer(str(axis), str(level), failing, len(probes), None, probes)
        reason = None if len(probes) == len(AC_ORDER) else \
            f"stopped after fit_search.max_probes={max_probes}"
        return AxisAnswer(str(axis), None, str(AC_ORDER[len(probes) - 1]), len(probes), reason,
                          probes)
    values, start = _candidates(cfg, axis)

    def indistinct(a: int, b: int) -> bool:  # two probed values' peaks within the band
        peak = {p["value"]: p["predicted_reserved_peak_bytes"] for p in probes}
        low, high = peak[values[a]], peak[values[b]]
        return high - low <= probes[-1]["error_band"] * high

    ok, fail, reason = gallop_bisect(values, start, lambda v: prober.fits(axis, v, probes),
                                     max_probes, indistinct)
    return AxisAnswer(str(axis), None if ok is None else values[ok],
                      None if fail is None else values[fail], len(probes), reason, probes)


def fit_search(cfg: FitSearchRunConfig, name: str | None = None,
               on_probe: Callable[[dict], None] = lambda record: None) -> list[AxisAnswer]:
    """Every axis of ``cfg.fit_search.axes``, searched in turn; ``on_probe`` sees each probe's
    record as it finishes (axis, value, allocated and reserved peaks, usable capacity,
    headroom, verdict, probe_s). ConfigError before any capture on a bad config."""
    cfg.validate()
    name = name or f"{cfg.workload.model}_{cfg.workload.parallel}"
    axes = [Axis(a) for a in dict.fromkeys(cfg.fit_search.axes)]
    prober = _Prober(cfg, name, on_probe)
    workers = min(cfg.fit_search.num_workers, len(axes))
    on_ray = cfg.fit_search.executor == Executor.ray
    if workers <= 1 and not on_ray:
        return [search_axis(cfg, axis, prober) for axis in axes]
    prober.predict_job()
    tasks = [(cfg, name, axis, prober.done, i == 0) for i, axis in enumerate(axes)]
    # each probe reported the moment a worker finishes it (axes interleave), answers in order
    if not on_ray:
        return list(in_workers(_search_in_worker, tasks, workers, on_message=on_probe))
    from orchestrator.cluster.ray_pool import in_ray_tasks  # ray: only for a search on Ray

    # an axis' bound: each probe a capture and a dry run, within the capture's bound each
    axis_bound_s = cfg.fit_search.max_probes * 2 * cfg.predict.capture_timeout_s
    return [answer for answer, _node in in_ray_tasks(
        _search_in_worker, tasks, workers, ClusterConfig(address=cfg.fit_search.ray_address),
        axis_bound_s, lambda i: f"fit_search's {axes[i]} axis", on_message=on_probe)]


def _search_in_worker(cfg: FitSearchRunConfig, name: str, axis: Axis,
                      done: dict[tuple, Prediction], first: bool) -> AxisAnswer:
    """One axis' search in a worker process (the probes come back in the answer); the first
    axis' probe of the job stands for the job's prediction (made by the parent)."""
    prober = _Prober(cfg, name, tell_parent, done)
    if first:
        prober.made_for_me = set(done)
    return search_axis(cfg, axis, prober)


def run_fit_search(cfg: FitSearchRunConfig, out_dir: Path, name: str | None = None) -> dict:
    """``tracefleet-predict experiment=fit_search``: the search with one progress line and one
    results row per probe, ``fit_search.json``, a plot per axis in ``out_dir``, the answers
    printed as a table; returns the summary written to ``fit_search.json``."""
    recorder = FitSearchRecorder(Path(out_dir), cfg)
    t0 = time.perf_counter()
    answers = fit_search(cfg, name, recorder.probe)
    summary = recorder.finish(answers, time.perf_counter() - t0)
    # the job's own prediction.json and prediction.html (its capture is cached by now), the
    # page with the search's plots and answers
    page = PredictionPage([(f"fit_search: {axis}", Path(out_dir) / a["plot"])
                           for axis, a in summary["answers"].items() if a["plot"]],
                          [(answers_title(summary), ANSWER_COLUMNS, answer_rows(summary))])
    predict(_as_predict_config(cfg), Path(out_dir), name=name, sinks=prediction_sinks(page))
    return summary
