"""The profiler (Kineto) trace recorded beside an ET: host time between top-level ops.

An ET records operators, not the Python and framework time between them. Capture writes a
profiler trace beside it (``rank-<r>.kineto.json.gz`` next to ``rank-<r>.et.json.gz``).
Both carry the record-function id of every op: the ET node's ``rf_id`` attr and the
Kineto ``cpu_op`` event's ``args["Record function id"]``, with the event's ``ts``/``dur``
in microseconds. Capture's file holds the timing of a bare profiler-only iteration keyed to
the ET's ids (see actors/capture/host_profile.py). Pure data: orjson only.
"""
from __future__ import annotations

import bisect
import re
from dataclasses import dataclass
from pathlib import Path

import orjson

from actors.errors import TraceError
from actors.trace import archive
from actors.trace.model import Trace

_ET_NAME = re.compile(r"^(?P<stem>.+?)(?:\.et)?\.json(?:\.gz)?$")
_KINETO_SUFFIXES = (".kineto.json.gz", ".kineto.json")
_RF_ID = "Record function id"
_US_PER_S = 1e6
_DEVICE_RUNTIME = ("cuda_runtime", "cuda_driver")
_PROFILED_CATS = ("cpu_op", "user_annotation")  # events with per-op profiler bookkeeping
# A profile of one iteration; past this (read or inflated) it is not the file capture wrote.
MAX_PROFILE_BYTES = 2 << 30
_TOO_BIG = ("a profiler trace of one iteration is far smaller: expected the "
            "<rank>.kineto.json.gz tracefleet-capture writes beside the ET")


def kineto_path_for(trace_path) -> Path | None:
    """The profiler trace next to an ET file (``rank-0.et.json.gz`` -> ``rank-0.kineto.json.gz``,
    or ``.kineto.json``), None when there is none."""
    path = Path(trace_path)
    m = _ET_NAME.match(path.name)
    if m is None:
        return None
    for suffix in _KINETO_SUFFIXES:
        candidate = path.with_name(m.group("stem") + suffix)
        if candidate.is_file():
            return candidate
    return None


def read_kineto_doc(kineto_path, max_bytes: int = MAX_PROFILE_BYTES) -> dict:
    """A Kineto trace file's JSON object (gzip or plain, at most ``max_bytes`` read or
    inflated); TraceError naming the file."""
    path = Path(kineto_path)
    data = archive.read_file(path, max_bytes, _TOO_BIG)
    if archive.is_gzip(data):
        data = archive.gunzip(data, max_bytes, path, _TOO_BIG)
    try:
        doc = orjson.loads(data)
    except orjson.JSONDecodeError as e:
        raise TraceError(path, f"invalid JSON ({e}); expected a Kineto trace object") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        raise TraceError(path, "expected a Kineto trace: a JSON object with a 'traceEvents' list")
    return doc


def read_kineto(kineto_path, max_bytes: int = MAX_PROFILE_BYTES) -> list[dict]:
    """The ``traceEvents`` of a Kineto trace file (at most ``max_bytes``, see read_kineto_doc)."""
    return read_kineto_doc(kineto_path, max_bytes)["traceEvents"]


@dataclass(frozen=True)
class HostTimes:
    """The host thread's time around every op of a trace, from its profiler trace."""

    #: per op of ``trace.ops``: idle host time before it (see :func:`host_times`)
    gaps_s: list[float]
    #: per op: its own recorded duration on the host thread, 0.0 where the profile has none
    op_s: list[float]
    #: the profiled step ranges' total duration (0.0 without ``ProfilerStep#`` ranges)
    step_s: float
    #: events the profiler recorded on the host thread inside the step ranges, less those
    #: inside collectives: each one's bookkeeping is in the host time (gaps and op_s)
    num_events: int = 0


def host_gaps_s(trace: Trace, kineto_path) -> list[float]:
    """Per op of ``trace.ops``: CPU seconds the original spent after the previous top-level op
    ended and before this one started (:func:`host_times`' ``gaps_s``)."""
    return host_times(trace, kineto_path).gaps_s


def host_times(trace: Trace, kineto_path) -> HostTimes:
    """The host time of every op of ``trace`` and before it, from its profiler trace.

    Measured on the thread that ran the step (its ``ProfilerStep#<n>`` range's thread); the
    first op of a step from the start of that range. "Previous" is the previous op the
    profile holds: an op it does not hold (no ``rf_id``, not profiled under the same name,
    such as the module ranges' hook ops, which the bare timing iteration does not run) gets
    0.0, and the next gap spans it. Time the thread spent blocked on work of other threads
    is not host time (a collective's ``work.wait()``, which no op records, waits for the
    ``gloo:*`` range on a worker thread; a device synchronize waits for the GPU): the gap
    starts when the last such work that ended inside it ended, and the replay's collectives
    take that time themselves. Ops of other threads and negative gaps give 0.0.
    TraceError when the file is unreadable or no op links to it (another run's profile).
    """
    events = [e for e in read_kineto(kineto_path) if isinstance(e, dict) and e.get("ph") == "X"]
    _check_times(events, kineto_path)
    spans = _op_spans(events)
    if not spans:
        raise TraceError(kineto_path, f"no cpu_op event carries args[{_RF_ID!r}]; expected the "
                                      "torch.profiler trace recorded with the ET")
    step_events = {e.get("name"): e for e in events if e.get("cat") == "user_annotation"}
    gaps, op_s, linked = [0.0] * len(trace.ops), [0.0] * len(trace.ops), 0
    windows = [(s.name, s.first, s.end) for s in trace.steps] or [(None, 0, len(trace.ops))]
    for name, first, end in windows:
        linked += _step_gaps(trace, first, end, step_events.get(name), events, spans, gaps, op_s)
    if trace.ops and not linked:
        raise TraceError(kineto_path, f"none of the {len(trace.ops)} ops of {trace.path} links to "
                                      "this profiler trace (record-function id and name); "
                                      "expected the profile of the same recorded iteration")
    steps = [step_events[name] for name, _, _ in windows if name in step_events]
    step_us = sum(float(e.get("dur", 0.0)) for e in steps)
    collectives = [spans[op.rf_id] for op in trace.ops
                   if op.collective is not None and op.rf_id in spans]
    return HostTimes(gaps, op_s, step_us / _US_PER_S, _count_host_events(events, steps, collectives))


def _count_host_events(events: list[dict], steps: list[dict], collectives: list[tuple]) -> int:
    """Op and range events on each step's thread inside the step, not inside a collective."""
    count = 0
    for step in steps:
        tid, begin = step.get("tid"), float(step["ts"])
        end = begin + float(step.get("dur", 0.0))
        inside = [(s[1], s[2]) for s in collectives if s[3] == tid and begin <= s[1] <= end]
        for ev in events:
            if ev is step or ev.get("tid") != tid or ev.get("cat") not in _PROFILED_CATS:
                continue
            try:
                ts = float(ev["ts"])
            except (KeyError, TypeError, ValueError):
                continue
            if begin <= ts <= end and not any(a <= ts <= b for a, b in inside):
                count += 1
    return count


def _step_gaps(trace: Trace, first: int, end: int, step_ev: dict | None, events: list[dict],
               spans: dict, gaps: list[float], op_s: list[float]) -> int:
    """Fill gaps[first:end] and op_s[first:end] for one step window; returns how many of its
    ops linked."""
    host_tid = step_ev.get("tid") if step_ev else None
    prev_end = float(step_ev["ts"]) if step_ev else None
    blocked = _BlockedUntil(events, host_tid)
    linked = 0
    for i in range(first, end):
        op = trace.ops[i]
        span = spans.get(op.rf_id) if op.rf_id is not None else None
        if span is None or span[0] != op.name:
            continue  # not in this profile (or the id of another op): the next gap spans it
        linked += 1
        if span[3] != host_tid:
            continue
        start = span[1]
        op_s[i] = (span[2] - start) / _US_PER_S
        if prev_end is not None:
            begin = max(prev_end, blocked.last_end(prev_end, start))
            if start > begin:
                gaps[i] = (start - begin) / _US_PER_S
        prev_end = span[2]
    return linked


def _check_times(events: list[dict], path) -> None:
    """Every complete event's ``ts`` (and ``dur``, when present) is a finite number >= 0: the
    gaps are computed from them, so a malformed one is an error naming it, not a silent 0."""
    for i, ev in enumerate(events):
        for key in ("ts", "dur"):
            if key not in ev and key == "dur":
                continue
            v = ev.get(key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < float("inf"):
                raise TraceError(path, f"traceEvents: complete event #{i} ({str(ev.get('name'))[:60]!r}) "
                                       f"has {key}={str(v)[:40]!r}; expected a number of "
                                       "microseconds >= 0")


def _op_spans(events: list[dict]) -> dict[int, tuple[str, float, float, object]]:
    """rf_id -> (name, start us, end us, tid) of every cpu_op event."""
    spans = {}
    for ev in events:
        if ev.get("cat") != "cpu_op":
            continue
        args = ev.get("args")
        rf_id = args.get(_RF_ID) if isinstance(args, dict) else None
        if isinstance(rf_id, int) and not isinstance(rf_id, bool):
            start = float(ev["ts"])
            spans[rf_id] = (ev.get("name"), start, start + float(ev.get("dur", 0.0)), ev.get("tid"))
    return spans


class _BlockedUntil:
    """Ends of the work the host thread can block on: every event of another thread (gloo's
    collective ranges run on its worker threads), and device synchronizations."""

    def __init__(self, events: list[dict], host_tid):
        ends = []
        for ev in events:
            other = ev.get("tid") != host_tid
            sync = "Synchronize" in str(ev.get("name")) and ev.get("cat") in _DEVICE_RUNTIME
            if other or sync:
                ends.append(float(ev["ts"]) + float(ev.get("dur", 0.0)))
        self._ends = sorted(ends)

    def last_end(self, after: float, before: float) -> float:
        """The latest end in (after, before], or ``after`` when none."""
        i = bisect.bisect_right(self._ends, before) - 1
        return self._ends[i] if i >= 0 and self._ends[i] > after else after
