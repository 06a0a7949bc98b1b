"""A replay run's summary as a typed record: ``RunSummary``, what ``summary.json`` holds.

Its known core is typed: the status, world size and error, the rank rows, the run's own facts
(``RunFacts``) and what only a run that replayed to the end records (``ReplayedRun``: its
timings, warnings, the target, each rank-side extension's summary). The figures aggregated
from the ranks' reports (orchestrator/run/aggregate.py: times, peaks, coverage, collectives,
...) are open-ended, a field added there needs no line here: they stay one mapping,
``figures``, in the order aggregate gives them.

``to_dict`` is ``summary.json``'s object, key for key in the order the file has always had:
the status, world size and error, the figures, the ranks, then the run's facts with the
replayed run's interleaved where they always stood, the snapshots last. ``from_dict`` reads
one back (orchestrator/reports/summary_file.py checks every field by its name first): a key
it does not know is a figure before ``ranks`` and an extension's summary after it.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields

from orchestrator.errors import ResultsError
from orchestrator.outputs import SUMMARY_JSON

# the core's keys in summary.json (the rest are figures or extensions)
_CORE = ("status", "world_size", "error", "ranks")


@dataclass
class RunFacts:
    """What the run was: every summary records these (an interrupted run's too)."""

    experiment: str | None = None  # experiment.name
    trace_dir: str | None = None  # the traces replayed (trace.dir)
    mode: str | None = None  # replay.mode: compute or full
    allocation_mode: str | None = None  # replay.allocation.mode: lazy, faithful, ...
    trace_ranks: list[int] | None = None  # each rank's trace rank (pre-flight's)
    num_replays: int | None = None  # actors that replayed (one per distinct trace: dedup)


@dataclass
class ReplayedRun:
    """What a run that replayed to the end records beside its figures (an interrupted run's
    summary has none of it)."""

    device_memory_capacity_bytes: int | None = None  # the smallest rank's device capacity
    timings_s: dict[str, float] = field(default_factory=dict)  # each phase (run/phases.py)
    preflight_warnings: list[str] = field(default_factory=list)
    machine_warnings: list[str] = field(default_factory=list)  # a busy or small machine
    # per rank-side extension (ZeRO-3's), its summary under its name (None: no rank had one)
    extensions: dict[str, dict | None] = field(default_factory=dict)
    target: dict | None = None  # the target's figures, when one was set


@dataclass
class RunSummary:
    """One replay run's summary (see the module docstring)."""

    status: str  # a RunStatus: the override, else the ranks' worst (run/aggregate.py)
    world_size: int
    error: str | None  # the run's error, naming the ranks that did not finish
    figures: dict  # aggregated over the ranks, in aggregate's order (open-ended)
    ranks: list[dict]  # one row per rank, in rank order, without the bulky timelines
    run: RunFacts = field(default_factory=RunFacts)
    replayed: ReplayedRun | None = None  # None: the run did not replay to the end
    # rank (as text) -> its allocator snapshot file; None (and no key) before they were written
    snapshots: dict[str, str] | None = None

    def to_dict(self) -> dict:
        """``summary.json``'s object (see the module docstring for its order)."""
        run, done = self.run, self.replayed
        out = {"status": self.status, "world_size": self.world_size, "error": self.error,
               **self.figures, "ranks": self.ranks, "experiment": run.experiment,
               "trace_dir": run.trace_dir, "mode": run.mode,
               "allocation_mode": run.allocation_mode}
        if done is not None:
            out.update(device_memory_capacity_bytes=done.device_memory_capacity_bytes,
                       timings_s=done.timings_s)
        out["trace_ranks"] = run.trace_ranks
        if done is not None:
            out["preflight_warnings"] = done.preflight_warnings
        out["num_replays"] = run.num_replays
        if done is not None:
            out.update(machine_warnings=done.machine_warnings, **done.extensions,
                       target=done.target)
        if self.snapshots is not None:
            out["snapshots"] = self.snapshots
        return out

    @classmethod
    def from_dict(cls, data: dict, path=SUMMARY_JSON) -> "RunSummary":
        """The summary ``data`` holds (``summary.json``'s object, read from ``path``);
        ResultsError naming the file and the field when the core is missing or mistyped."""
        for key in ("status", "world_size"):
            if key not in data:
                raise ResultsError(f"{path}: {key}: missing (not a run summary)")
        if type(data["world_size"]) is not int or data["world_size"] < 0:
            raise ResultsError(f"{path}: world_size: {data['world_size']!r} is not a number "
                               "of ranks (an integer >= 0)")
        if not isinstance(data["status"], str):
            raise ResultsError(f"{path}: status: {data['status']!r} is not a string")
        facts = {f.name for f in fields(RunFacts)}
        done_keys = {f.name for f in fields(ReplayedRun)} - {"extensions"}
        known = {*_CORE, *facts, *done_keys, "snapshots"}
        keys = list(data)
        after = keys.index("ranks") if "ranks" in keys else len(keys)
        figures = {k: data[k] for k in keys[:after] if k not in known}
        extensions = {k: data[k] for k in keys[after:] if k not in known}
        replayed = None
        if extensions or done_keys & set(keys):
            replayed = ReplayedRun(**{k: data[k] for k in done_keys if k in data},
                                   extensions=extensions)
        return cls(status=data["status"], world_size=data["world_size"],
                   error=data.get("error"), figures=figures, ranks=data.get("ranks") or [],
                   run=RunFacts(**{k: data[k] for k in facts if k in data}),
                   replayed=replayed, snapshots=data.get("snapshots"))
