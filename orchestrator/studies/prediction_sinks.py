"""The sinks of a prediction (orchestrator/sinks.py): the snapshots, the timelines and
``prediction.json``, the page, the console table, each handed the finished
``PredictionResult``.

``prediction.json`` lists the snapshots and the timelines' plot, so it is written at ``close``,
after every sink wrote, whole or not at all: a sink that fails before it (a full disk) leaves
none, and one that is there names only files that were written.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import orjson

from actors.atomic_file import atomic_write
from actors.replay.memory.snapshot import write_snapshots
from orchestrator.outputs import PREDICTION_HTML, RunDir
from orchestrator.reports.predict_table import prediction_table
from orchestrator.reports.predict_timelines import write_timelines
from orchestrator.reports.prediction_page import write_prediction_page
from orchestrator.sinks import Sink
from orchestrator.studies.prediction import Prediction


@dataclass
class PredictionResult:
    """A finished prediction as its sinks get it."""

    prediction: Prediction
    reports: dict[int, dict]  # the dry run's report of each distinct trace, by rank
    out_dir: Path | None  # None: nothing is written (a sink that writes needs one)
    # rank -> its allocator snapshot (predict.snapshot), not yet written
    snapshots: dict[int, dict] = field(default_factory=dict)


class PredictionSnapshots(Sink[PredictionResult]):
    """``snapshot_rank<r>.pickle`` per distinct trace (when recorded), named in the
    prediction, and the time the allocator model took to record them."""

    def write(self, result: PredictionResult) -> None:
        p = result.prediction
        p.snapshots = write_snapshots(result.out_dir, result.snapshots)
        p.timings_s["snapshot_s"] = sum(r["cuda_allocator"].get("snapshot_s", 0.0)
                                        for r in result.reports.values())


class PredictionFiles(Sink[PredictionResult]):
    """The timelines (one CSV per role, their plot) at write; ``prediction.json`` at close."""

    def write(self, result: PredictionResult) -> None:
        p = result.prediction
        p.memory_timelines = write_timelines(result.out_dir, result.reports, p.per_role)

    def close(self, result: PredictionResult) -> None:
        atomic_write(RunDir(result.out_dir).prediction,
                     orjson.dumps(result.prediction.to_dict(), option=orjson.OPT_INDENT_2))


@dataclass
class PredictionPage(Sink[PredictionResult]):
    """``prediction.html`` and its plots; ``extra_plots`` (title, png) and ``extra_tables``
    (title, header, rows) after the prediction (fit_search's answers)."""

    extra_plots: list = field(default_factory=list)
    extra_tables: list = field(default_factory=list)

    def write(self, result: PredictionResult) -> None:
        write_prediction_page(result.out_dir, result.prediction.to_dict(), self.extra_plots,
                              self.extra_tables)


class PredictionConsole(Sink[PredictionResult]):
    """The table ``tracefleet-predict`` prints, then where its files are (when written)."""

    def close(self, result: PredictionResult) -> None:
        print(prediction_table(result.prediction.to_dict()))
        if result.out_dir is not None:
            print(f"prediction: {RunDir(result.out_dir).prediction}")
            print(f"page: {result.out_dir / PREDICTION_HTML}")


def prediction_sinks(page: PredictionPage | None = None) -> list[Sink[PredictionResult]]:
    """A prediction's files: snapshots, timelines, the page (``page``, default a plain one)
    and prediction.json, last."""
    return [PredictionSnapshots(), PredictionFiles(), page or PredictionPage()]
