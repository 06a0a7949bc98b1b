"""The sinks of a replay run (orchestrator/sinks.py): its files, its snapshots, the console
table, the HTML page and the outputs listing, each handed the finished ``RunResult``.

``default_sinks`` is what ``tracefleet`` shows and writes, in the order users see it: the files
and snapshots, the table, then (once the timings are final) summary.json rewritten with them,
the page, and where it all went, last, where the eye lands. ``file_sinks`` is the files alone,
without plots: a search's probes (``quiet_replays``), that nobody reads one by one.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from actors.replay.memory.snapshot import write_snapshots
from orchestrator.reports import run_report as report
from orchestrator.reports.html_report import write_report
from orchestrator.run_summary import RunSummary
from orchestrator.sinks import Sink


@dataclass
class RunResult:
    """A finished replay run as its sinks get it."""

    summary: RunSummary
    rank_reports: list[dict]  # the raw reports, with their memory timelines
    out_dir: Path
    config_yaml: str | None = None  # written as config.yaml when given
    # rank -> its allocator snapshot (replay.allocator_snapshot), not yet written
    snapshots: dict[int, dict] = field(default_factory=dict)


@dataclass
class RunFiles(Sink[RunResult]):
    """summary.json, the ranks tables, config.yaml, the memory timelines and (``plots``) the
    plots (reports/run_report.py); summary.json rewritten at close with the final timings."""

    plots: bool = True

    def write(self, result: RunResult) -> None:
        report.write_run_outputs(result.summary.to_dict(), result.rank_reports, result.out_dir,
                                 result.config_yaml, plots=self.plots)

    def close(self, result: RunResult) -> None:
        report.write_summary(result.summary.to_dict(), result.out_dir)


class SnapshotFiles(Sink[RunResult]):
    """The allocator snapshots, one file per replayed rank, named in the summary."""

    def write(self, result: RunResult) -> None:
        result.summary.snapshots = write_snapshots(result.out_dir, result.snapshots)


@dataclass
class ConsoleTable(Sink[RunResult]):
    """The rank table, the collectives and the footer lines (``None``: a console of its own)."""

    console: object = None

    def write(self, result: RunResult) -> None:
        report.print_summary(result.summary.to_dict(), self.console)


class ReportPage(Sink[RunResult]):
    """report.html and its plots (experiment.report), once summary.json is final."""

    def close(self, result: RunResult) -> None:
        write_report(result.out_dir)


@dataclass
class OutputsListing(Sink[RunResult]):
    """The run's folder, what is in it and its page: the last lines printed."""

    console: object = None

    def close(self, result: RunResult) -> None:
        report.print_outputs(result.out_dir, self.console)


def file_sinks() -> list[Sink[RunResult]]:
    """The run's files without plots, shown nowhere: a search's probes."""
    return [RunFiles(plots=False), SnapshotFiles()]


def default_sinks(page: bool = True, console=None) -> list[Sink[RunResult]]:
    """Everything ``tracefleet`` writes and shows (``page``: experiment.report)."""
    return [RunFiles(), SnapshotFiles(), ConsoleTable(console),
            *([ReportPage()] if page else []), OutputsListing(console)]
