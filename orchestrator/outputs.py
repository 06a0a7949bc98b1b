"""Every file tracefleet writes into a folder, named once; ``RunDir`` joins them to one.

- a replay run (``tracefleet``, orchestrator/run/sinks.py and reports/run_report.py):
  ``summary.json``, ``preflight.json``, ``ranks.csv``/``ranks.parquet``, ``config.yaml``, the
  memory timelines under ``memory/``, ``memory_timeline.png``, ``iteration_times.png``;
- a prediction (``tracefleet-predict``, studies/prediction_sinks.py and reports/prediction_page.py):
  ``prediction.json``, ``prediction.html`` and its plots under ``prediction/``,
  ``memory_timelines.png``;
- a sweep or study (results.py, reports/html_report.py, studies/fit_search_report.py):
  ``results.csv``/``results.parquet`` (the rows under ``rows/``), ``report.html`` and its plots
  under ``report/``, ``oom_study.png``, ``fit_search.json``;
- a capture (run/capture.py, run/fake_check.py): the rank traces
  (actors/trace/conventions.py), ``meta.json`` (named and built by actors/trace/meta_file.py,
  beside its reader) and ``check_fake.json``.

Writers and readers (the CLI, the studies, the scripts) take the names from here: renaming a
file is one line.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from actors.trace.meta_file import META_JSON

SUMMARY_JSON = "summary.json"
PREFLIGHT_JSON = "preflight.json"
RANKS_CSV = "ranks.csv"
RANKS_PARQUET = "ranks.parquet"
CONFIG_YAML = "config.yaml"
MEMORY_DIR = "memory"  # rank-<r>.csv: one memory timeline per rank
MEMORY_TIMELINE_PNG = "memory_timeline.png"
ITERATION_TIMES_PNG = "iteration_times.png"

PREDICTION_JSON = "prediction.json"
PREDICTION_HTML = "prediction.html"
PREDICTION_PLOTS_DIR = "prediction"
MEMORY_PNG = "memory.png"
STREAMS_PNG = "streams.png"
MEMORY_TIMELINES_PNG = "memory_timelines.png"

RESULTS_CSV = "results.csv"
RESULTS_PARQUET = "results.parquet"
ROWS_DIR = "rows"  # one file per measured row: nothing measured is lost
REPORT_HTML = "report.html"
REPORT_PLOTS_DIR = "report"
OOM_STUDY_PNG = "oom_study.png"
FIT_SEARCH_JSON = "fit_search.json"

CHECK_FAKE_JSON = "check_fake.json"


@dataclass(frozen=True)
class RunDir:
    """A folder tracefleet wrote (a run, a prediction, a study or a capture) and its files."""

    root: Path

    def __post_init__(self):
        object.__setattr__(self, "root", Path(self.root))

    @property
    def summary(self) -> Path:
        return self.root / SUMMARY_JSON

    @property
    def preflight(self) -> Path:
        return self.root / PREFLIGHT_JSON

    @property
    def prediction(self) -> Path:
        return self.root / PREDICTION_JSON

    @property
    def results_csv(self) -> Path:
        return self.root / RESULTS_CSV

    @property
    def meta(self) -> Path:
        return self.root / META_JSON
