"""Aggregate the per-rank reports of one run into the run summary.

A rank report may be partial: a rank that failed early may carry only ``rank``, ``status``,
``error`` and ``last_op``. Every statistic is computed over the ranks that reported the
value, so nothing a surviving rank measured is lost; ranks that sent no report at all get a
placeholder row so the summary still has one row per rank.

Run status precedence (root cause first, orchestrator/status.py): ``oom`` > ``failed`` >
``timeout`` > ``ok``.
An OOM is the most specific diagnosis and usually the cause of the others (its peers then
error out on a broken connection or block in the next collective), and a timeout is most
often collateral, so it ranks last. An unknown rank status counts as ``failed``. A run-level
override (e.g. the driver's own deadline expired) wins over every rank.
"""
from __future__ import annotations

import re

from statistics import median

from actors.rank_actor import RANK_EXTENSIONS
from actors.replay.failure import FailureReport
from actors.replay.timed_iterations import interval_fields, median_interval
from orchestrator.run_summary import ReplayedRun, RunFacts, RunSummary
from orchestrator.status import FAILURE_PRECEDENCE, REPLAY_STATUSES, RunStatus

MAX_RANKS_IN_ERROR = 4  # name this many failing ranks in full, summarize the rest
MAX_RANK_ERROR_CHARS = 200
# the place at the end of a rank's error (actors.errors.describe), at most ~120 characters
_PLACE = re.compile(r"(?: at node -?\d+ \S{1,60})?(?: \(phase \w+\))(?: \[[^\]]{1,80}\])?$")

_BULKY = ("memory_timeline",)  # per-rank series written to files of their own (memory/)
_COLLECTIVE_SUM_FIELDS = ("num_calls", "bytes")
_COLLECTIVE_MEDIAN_FIELDS = ("time_s", "algbw_gbps", "busbw_gbps")


def _values(reports: list[dict], key: str) -> list:
    """The non-missing values of ``key`` over the reports, in rank order."""
    return [r[key] for r in reports if r.get(key) is not None]


def _median_or_none(values: list):
    return median(values) if values else None


def worst_status(statuses) -> RunStatus:
    """The run status implied by the rank statuses, following ``FAILURE_PRECEDENCE``."""
    normalized = {s if s in REPLAY_STATUSES else RunStatus.failed for s in statuses}
    for status in FAILURE_PRECEDENCE:
        if status in normalized:
            return status
    return RunStatus.ok


def _one_line(text: str) -> str:
    """The first line, cut to MAX_RANK_ERROR_CHARS; the place a rank names at its end (node,
    phase, code: actors.errors.describe) is kept, the message is cut before it."""
    line = str(text).strip().splitlines()[0] if str(text).strip() else ""
    if len(line) <= MAX_RANK_ERROR_CHARS:
        return line
    place = _PLACE.search(line)
    tail = place.group(0) if place else ""
    return line[: MAX_RANK_ERROR_CHARS - 3 - len(tail)] + "..." + tail


def _rank_error(report: dict) -> str:
    """``rank R <status> at <last op>: <error>``, naming the rank and the op only once."""
    head = f"rank {report['rank']} {report.get('status', RunStatus.failed)}"
    error = _one_line(report["error"]) if report.get("error") else ""
    for own in (f"rank {report['rank']}: ", f"rank {report['rank']} "):
        if error.startswith(own):  # rank actors already name themselves
            error = error[len(own):]
            if error.startswith("at "):
                return f"{head} {error}"
            break
    last = report.get("last_op")
    where = f" at {last}" if last and last not in error else ""
    return f"{head}{where}: {error}" if error else f"{head}{where}"


def _error_message(bad: list[dict], world_size: int, run_error: str | None) -> str | None:
    """One message naming the failing ranks (root causes first) and their last op."""
    parts = [run_error] if run_error else []
    if bad:
        order = {s: i for i, s in enumerate(FAILURE_PRECEDENCE)}
        bad = sorted(bad, key=lambda r: (order.get(r.get("status"), 1), r["rank"]))
        named = "; ".join(_rank_error(r) for r in bad[:MAX_RANKS_IN_ERROR])
        rest = bad[MAX_RANKS_IN_ERROR:]
        if rest:
            by_status: dict[str, list[int]] = {}
            for r in rest:
                by_status.setdefault(str(r.get("status")), []).append(r["rank"])
            more = ", ".join(f"{s} on ranks {', '.join(map(str, rs))}" for s, rs in by_status.items())
            named += f"; and {len(rest)} more ({more})"
        parts.append(f"{len(bad)} of {world_size} ranks did not finish: {named}")
    return "; ".join(parts) or None


def _merge_collectives(reports: list[dict]) -> dict:
    """Per collective kind: calls and bytes summed over ranks, time and bandwidths median over ranks."""
    per_kind: dict[str, list[dict]] = {}
    for report in reports:
        for kind, stats in (report.get("collectives") or {}).items():
            per_kind.setdefault(kind, []).append(stats)
    merged = {}
    for kind, rows in sorted(per_kind.items()):
        entry: dict = {"num_ranks": len(rows)}
        for field in _COLLECTIVE_SUM_FIELDS:
            entry[field] = sum(_values(rows, field))
        for field in _COLLECTIVE_MEDIAN_FIELDS:
            entry[field] = _median_or_none(_values(rows, field))
        merged[kind] = entry
    return merged


def _merge_counts(reports: list[dict], key: str) -> dict[str, int]:
    total: dict[str, int] = {}
    for report in reports:
        for reason, count in (report.get(key) or {}).items():
            total[reason] = total.get(reason, 0) + count
    return dict(sorted(total.items(), key=lambda kv: -kv[1]))


def slowest_series_s(ranks: list[dict]) -> list[float]:
    """Per iteration every reporting rank finished, the slowest rank's time."""
    series = [r["iteration_times_s"] for r in ranks if r.get("iteration_times_s")]
    if not series:
        return []
    return [max(s[k] for s in series) for k in range(min(len(s) for s in series))]


def slowest_iteration_s(ranks: list[dict]) -> float | None:
    """The step time of a synchronous job: per iteration the slowest rank's time, then the
    median over iterations (iterations every reporting rank finished)."""
    return _median_or_none(slowest_series_s(ranks))


def _memory(ranks: list[dict]) -> dict:
    """Max over ranks of each memory figure; the headline peak is the largest rank peak
    (each rank's measured figure where it has one), with that rank's source."""
    top = max((r for r in ranks if r.get("peak_memory_bytes") is not None),
              key=lambda r: r["peak_memory_bytes"], default={})
    return {"measured_peak_bytes": max(_values(ranks, "measured_peak_bytes"), default=None),
            "accounted_peak_bytes": max(_values(ranks, "accounted_peak_bytes"), default=None),
            "peak_memory_bytes": top.get("peak_memory_bytes"),
            "peak_memory_source": top.get("peak_memory_source", "accounted") if top else None,
            "memory_measure_method": next(iter(_values(ranks, "memory_measure_method")), None),
            "persistent_bytes": max(_values(ranks, "persistent_bytes"), default=None),
            # the caching allocator model of target (predicted, not measured)
            "predicted_reserved_peak_bytes": max(_values(ranks, "predicted_reserved_peak_bytes"),
                                                 default=None),
            "predicted_allocated_peak_bytes": max(_values(ranks, "predicted_allocated_peak_bytes"),
                                                  default=None),
            "num_alloc_retries": sum(_values(ranks, "num_alloc_retries"))
            if _values(ranks, "num_alloc_retries") else None,
            "num_predicted_ooms": sum(_values(ranks, "num_predicted_ooms"))
            if _values(ranks, "num_predicted_ooms") else None,
            "device_memory_threshold": next(iter(_values(ranks, "device_memory_threshold")), None),
            **_peak_breakdown(ranks)}


def _peak_breakdown(ranks: list[dict]) -> dict:
    """The accounted peak's breakdown by category and its op, of the rank with the largest
    accounted peak (computed from the trace: actors/trace/categories.py)."""
    top = max((r for r in ranks if r.get("peak_breakdown")),
              key=lambda r: r.get("accounted_peak_bytes") or 0, default=None)
    if top is None:
        return {"peak_breakdown": None, "peak_op": None}
    return {"peak_breakdown": top["peak_breakdown"],
            "peak_op": {"rank": top["rank"], **top["peak_op"]} if top.get("peak_op") else None}


def _not_run(ranks: list[dict]) -> dict:
    """The ops that did not run as recorded on the rank with the lowest coverage (the weakest
    rank bounds what the replay is worth), with that rank."""
    weakest = min((r for r in ranks if r.get("coverage") is not None),
                  key=lambda r: r["coverage"], default=None)
    if weakest is None:
        return {"not_run_ops": [], "not_run_rank": None}
    return {"not_run_ops": weakest.get("not_run_ops") or [], "not_run_rank": weakest["rank"]}


def _first_oom(reports: list[dict]) -> dict | None:
    for report in reports:
        if report.get("status") == RunStatus.oom or report.get("oom"):
            return {"rank": report["rank"], **(report.get("oom") or {})}
    return None


def extension_summaries(rank_reports: list[dict], extensions=RANK_EXTENSIONS) -> dict:
    """Per rank-side extension (ZeRO-3's), its part of the run summary under its ``name``:
    its own ``summarize_ranks`` over the ranks' parts (None where no rank has one)."""
    return {ext.name: ext.summarize_ranks([r[ext.name] for r in rank_reports
                                           if isinstance(r.get(ext.name), dict)])
            for ext in extensions}


def _rank_rows(rank_reports: list[dict], world_size: int, missing_status: RunStatus) -> list[dict]:
    """Per-rank rows in rank order without the bulky memory timeline; placeholders for silent ranks."""
    rows = {r["rank"]: {k: v for k, v in r.items() if k not in _BULKY} for r in rank_reports}
    for rank in range(world_size):
        if rank not in rows:
            rows[rank] = FailureReport.missing(rank, missing_status).to_dict()
    return [rows[rank] for rank in sorted(rows)]


def aggregate(rank_reports: list[dict], *, world_size: int,
              run_status_override: RunStatus | None = None,
              error: str | None = None, extra: dict | None = None) -> dict:
    """Aggregate per-rank reports into the run summary (see the module docstring for the rules).

    ``run_status_override`` replaces the status derived from the ranks; ``error`` is a
    run-level message put before the per-rank ones; ``extra`` adds keys (e.g.
    ``device_memory_capacity_bytes``) and may not shadow a computed key.
    """
    allowed = (*REPLAY_STATUSES, RunStatus.interrupted)
    if run_status_override is not None and run_status_override not in allowed:
        raise ValueError(f"run_status_override must be one of "
                         f"{[str(s) for s in allowed]}, got {run_status_override!r}")
    missing_status = RunStatus.failed if run_status_override in (None, RunStatus.ok) \
        else RunStatus(run_status_override)
    ranks = _rank_rows(rank_reports, world_size, missing_status)
    summary = {
        **_run_status(ranks, world_size, run_status_override, error),
        **_timing(ranks),
        **_memory(ranks),
        **_held(ranks),
        **_coverage(ranks),
        "collectives": _merge_collectives(ranks),
        "num_oom_ranks": sum(1 for r in ranks if r.get("status") == RunStatus.oom),
        "oom": _first_oom(ranks),
        "ranks": ranks,
    }
    clash = sorted(set(extra or {}) & set(summary))
    if clash:
        raise ValueError(f"extra keys {clash} would shadow computed summary keys")
    summary.update(extra or {})
    return summary


def summarize(rank_reports: list[dict], *, world_size: int, run: RunFacts,
              replayed: ReplayedRun | None = None,
              run_status_override: RunStatus | None = None,
              error: str | None = None) -> RunSummary:
    """The run summary record: the reports aggregated (``aggregate``) with the run's facts
    and, for a run that replayed to the end, what it alone records."""
    computed = aggregate(rank_reports, world_size=world_size,
                         run_status_override=run_status_override, error=error)
    assert replayed is None or not set(replayed.extensions) & set(computed), \
        "an extension's name shadows a summary figure"
    return RunSummary(status=computed["status"], world_size=world_size,
                      error=computed["error"], ranks=computed["ranks"],
                      figures={k: v for k, v in computed.items()
                               if k not in ("status", "world_size", "error", "ranks")},
                      run=run, replayed=replayed)


def _run_status(ranks: list[dict], world_size: int, override: RunStatus | None,
                error: str | None) -> dict:
    """The run's status (the override, else the ranks' worst), its error naming the ranks
    that did not finish, and how many ranks ended with each status."""
    status_counts: dict[str, int] = {}
    for r in ranks:
        status = str(r.get("status", RunStatus.failed))
        status_counts[status] = status_counts.get(status, 0) + 1
    bad = [r for r in ranks if r.get("status") != RunStatus.ok]
    return {"status": RunStatus(override) if override
            else worst_status(r.get("status") for r in ranks),
            "world_size": world_size,
            "error": _error_message(bad, world_size, error),
            "num_ranks_by_status": status_counts}


def _timing(ranks: list[dict]) -> dict:
    """The step time (a synchronous step ends when its slowest rank does), its interval, the
    ranks' medians, the straggler and the skew, compute and communication time."""
    rank_medians = {r["rank"]: r["iteration_time_s"] for r in ranks
                    if r.get("iteration_time_s") is not None}
    straggler = max(rank_medians, key=rank_medians.get) if rank_medians else None
    first = min(rank_medians, key=rank_medians.get) if rank_medians else None
    fastest = rank_medians[first] if first is not None else None
    by_rank = {r["rank"]: r for r in ranks}
    return {
        "iteration_time_s": slowest_iteration_s(ranks),
        # its 95% interval, min and max over the same series (actors/replay/timed_iterations.py)
        **interval_fields(slowest_series_s(ranks)),
        "timing_stop_reason": next(iter(_values(ranks, "timing_stop_reason")), None),
        "iteration_time_median_s": _median_or_none(list(rank_medians.values())),
        "iteration_time_stats_s": {
            "min": fastest,
            "median": _median_or_none(list(rank_medians.values())),
            "max": rank_medians[straggler] if straggler is not None else None,
        },
        "straggler_rank": straggler,
        "skew": rank_medians[straggler] / fastest if fastest else None,
        "straggler_distinct": _distinct(by_rank.get(straggler), by_rank.get(first)),
        "compute_time_s": _median_or_none(_values(ranks, "compute_time_s")),
        "comm_time_s": _median_or_none(_values(ranks, "comm_time_s")),
    }


def _distinct(slowest: dict | None, fastest: dict | None) -> bool | None:
    """Whether the slowest rank is slower beyond noise: its median's 95% interval lies wholly
    above the fastest rank's (None without both intervals: too few timed iterations)."""
    if not slowest or not fastest or slowest is fastest:
        return None
    high = median_interval(slowest.get("iteration_times_s") or [])
    low = median_interval(fastest.get("iteration_times_s") or [])
    return None if high is None or low is None else high.low > low.high


def _held(ranks: list[dict]) -> dict:
    """The liveness lower bound (max over ranks) and the flushes (summed)."""
    return {"liveness_lower_bound_bytes": max(_values(ranks, "liveness_lower_bound_bytes"),
                                              default=None),
            "num_flushes": sum(_values(ranks, "num_flushes")),
            "flushed_bytes": sum(_values(ranks, "flushed_bytes"))}


def _coverage(ranks: list[dict]) -> dict:
    """What ran as recorded: the weakest rank's coverage and not-run ops, the ops the loader
    left out, shape mismatches, and skipped, translated and stand-in ops summed."""
    return {
        # The weakest rank bounds what the replay is worth, so report the minimum, not a mean.
        "coverage": min(_values(ranks, "coverage"), default=None),
        # recorded ops the loader left out (outside every ProfilerStep window), summed
        "num_dropped_ops": sum(_values(ranks, "num_dropped_ops")),
        **_not_run(ranks),
        "num_shape_mismatches": sum(_values(ranks, "num_shape_mismatches")),
        "skipped_reasons": _merge_counts(ranks, "skipped_reasons"),
        "translated_ops": _merge_counts(ranks, "translated_ops"),
        "standin_ops": _merge_counts(ranks, "standin_ops"),
    }
