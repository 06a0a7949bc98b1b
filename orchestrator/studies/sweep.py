"""``tracefleet --multirun``: every point runs, each one's row lands in the results table, and
the exit code summarises the sweep.

- A point ending ``oom``, ``failed`` or ``timeout`` is a result: its row is written and the
  sweep goes on. A point whose config or traces are refused (a user error) gets a row with
  status ``invalid`` and the message, and the sweep goes on too.
- The sweep root is ``multirun/sweep-<hash of the command's overrides>`` unless
  ``hydra.sweep.dir`` is given, so running the same command again finds the rows it wrote
  and skips those points (``experiment.resume=false`` runs them again).
- With Hydra's basic launcher the points run one after another in this process on one
  ``ReplaySession``: Ray, the rank actors and the loaded traces are kept across points.
- Faults: a point whose Ray node dies ends ``failed`` with a reason naming the node, its
  actors are replaced for the next point; a point the cluster cannot place or start (a
  ``ClusterError``, after at most ``cluster.timeout_s``) is ``failed`` too, not ``invalid``:
  the point's config was not refused. A sweep whose driver was killed loses only the running
  point; the same command resumes, and first stops what the killed driver's embedded Ray left
  running (orchestrator/cluster/stale_cluster.py).
- Exit code, from every row at the sweep root: 2 if a point was invalid, else 1 if a point
  is not ``ok``, else 0. At the end the HTML report is written (``experiment.report``).
"""
from __future__ import annotations

import hashlib
import logging
import time
import traceback
from pathlib import Path
from typing import Callable

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from actors.errors import TracefleetError
from orchestrator.cluster import stale_cluster
from orchestrator.errors import USER_ERROR_EXIT, ClusterError
from orchestrator.results import ALLOCATION_MODE, DEVICE_THRESHOLD, STATUS, ResultsStore, \
    RowKind, make_row, point_key, summary_columns
from orchestrator.status import REPLAY_STATUSES, RunStatus

log = logging.getLogger("tracefleet")

SWEEP_ROOT = "multirun"
_MULTIRUN_FLAGS = ("--multirun", "-m")
# Overrides that do not change a point's result, left out of the sweep root's name.
_NOT_IN_SWEEP_ID = ("hydra.", "hydra/", "experiment.resume=", "experiment.report=")

_session = None  # the ReplaySession kept across the points of a sweep (basic launcher)
last_exit_code: int | None = None  # set when a sweep ends; main() exits with it


def with_sweep_dir(argv: list[str]) -> list[str]:
    """``argv`` plus ``hydra.sweep.dir=multirun/sweep-<id>`` for a multirun that names none;
    ``<id>`` hashes the sorted overrides, so the same command resumes in the same root."""
    if not any(a in _MULTIRUN_FLAGS for a in argv) or \
            any(a.startswith("hydra.sweep.dir=") for a in argv):
        return list(argv)
    overrides = sorted(a for a in argv if "=" in a and not a.startswith("-")
                       and not a.lstrip("+~").startswith(_NOT_IN_SWEEP_ID))
    digest = hashlib.sha1("\n".join(overrides).encode()).hexdigest()[:10]
    return [*argv, f"hydra.sweep.dir={SWEEP_ROOT}/sweep-{digest}"]


def in_multirun() -> bool:
    """Whether the current Hydra job is a point of a sweep."""
    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def exit_code(statuses) -> int:
    """2 when a point was a user error, 1 when a point is not ``ok``, else 0."""
    statuses = list(statuses)
    if RunStatus.invalid in statuses:
        return USER_ERROR_EXIT
    return 0 if all(s == RunStatus.ok for s in statuses) else 1


def shared_session(root: Path):
    """The session kept across points, when they run in this process one after another;
    None under another launcher (points in other processes each start their own). Its
    embedded cluster is recorded under the sweep ``root``; a record a killed sweep left there
    is dealt with first."""
    global _session
    if HydraConfig.get().runtime.choices.get("hydra/launcher") != "basic":
        return None
    if _session is None:
        from orchestrator.run.session import ReplaySession  # Ray: only once a point runs
        record = root / stale_cluster.RECORD_NAME
        stale_cluster.reap(record)
        _session = ReplaySession(processes_record=record)
    return _session


def close_session() -> None:
    """Stop the Ray cluster and actors kept for the sweep."""
    global _session
    if _session is not None:
        _session.close()
        _session = None


def run_point(cfg: DictConfig, run: Callable, debug: bool,
              report_user_error: Callable[[str], None]) -> dict:
    """Run one point (``run(run_cfg, out_dir, config_yaml, session) -> summary``) and record
    its row; returns the row. Never raises for the point's own failure or user error (which
    goes to ``report_user_error``, the CLI's one line); ``debug`` (``--debug``) re-raises them."""
    hc = HydraConfig.get()
    root, out_dir = Path(hc.sweep.dir).resolve(), Path(hc.runtime.output_dir)
    overrides = list(hc.overrides.task)
    key = point_key(overrides)
    store = ResultsStore(root)
    previous = store.get(key)
    if cfg.experiment.resume and previous and previous[STATUS] in REPLAY_STATUSES:
        log.info("point #%s already recorded (%s): skipped", hc.job.num, previous[STATUS])
        return previous
    run_dir = str(out_dir.relative_to(root)) if out_dir.is_relative_to(root) else str(out_dir)
    t0 = time.perf_counter()
    try:
        summary = run(OmegaConf.to_object(cfg), out_dir, OmegaConf.to_yaml(cfg),
                      shared_session(root))
        row = make_row(RowKind.point, key, overrides, summary[STATUS], summary.get("error"),
                       run_dir, _with_config(summary_columns(summary), cfg))
    except ClusterError as exc:  # the cluster could not run it (e.g. a node was lost)
        if debug:
            raise
        log.error("point #%s: %s", hc.job.num, exc)
        row = make_row(RowKind.point, key, overrides, RunStatus.failed, str(exc), run_dir)
    except TracefleetError as exc:
        if debug:
            raise
        report_user_error(f"point #{hc.job.num}: {exc}")
        row = make_row(RowKind.point, key, overrides, RunStatus.invalid, str(exc), run_dir)
    except Exception as exc:  # noqa: BLE001 (a crashed point is a failed result, not an abort)
        if debug:
            raise
        log.error("point #%s crashed:\n%s", hc.job.num, traceback.format_exc())
        close_session()  # its state is unknown: the next point starts clean
        row = make_row(RowKind.point, key, overrides, RunStatus.failed,
                       f"{type(exc).__name__}: {exc}", run_dir)
    row["point_s"] = time.perf_counter() - t0
    store.put(row)
    return row


def _with_config(metrics: dict, cfg: DictConfig) -> dict:
    """Fill the axes the plots need from the config where the summary lacks them."""
    alloc = cfg.replay.allocation
    if metrics.get(ALLOCATION_MODE) is None:
        metrics[ALLOCATION_MODE] = str(alloc.mode)
    if metrics.get(DEVICE_THRESHOLD) is None:
        metrics[DEVICE_THRESHOLD] = float(alloc.device_memory_threshold)
    if metrics.get("mode") is None:
        metrics["mode"] = str(cfg.replay.mode)
    return metrics


def finish(root: Path, write_report: bool) -> int:
    """End of a sweep: tables rebuilt, report written, kept cluster stopped; the exit code."""
    close_session()
    store = ResultsStore(root)
    rows = store.rows()
    if rows:
        store.write_tables()
    if write_report and rows:
        from orchestrator.reports.html_report import write_report as write_html  # matplotlib
        try:
            log.info("report: %s", write_html(root))
        except Exception:  # noqa: BLE001 (the results are safe; the report can be redone)
            log.error("writing the report failed (rerun tracefleet-report %s):\n%s", root,
                      traceback.format_exc())
    code = exit_code(r[STATUS] for r in rows)
    statuses = [r[STATUS] for r in rows]
    counts = {s: statuses.count(s) for s in dict.fromkeys(statuses)}
    log.info("sweep %s: %d points (%s); exit code %d", root, len(rows),
             ", ".join(f"{n} {s}" for s, n in counts.items()) or "none", code)
    return code


class SweepCallback(Callback):
    """Hydra callback (conf/tracefleet.yaml): finishes a sweep in the launching process."""

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        global last_exit_code
        last_exit_code = finish(Path(str(config.hydra.sweep.dir)), bool(config.experiment.report))
