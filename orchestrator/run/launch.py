"""Run one replay end to end: pre-flight, cluster, one actor per rank, aggregate, write."""
from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from pathlib import Path

import orjson

from actors.machine import replay_machine_warnings
from actors.replay.failure import FailureReport
from actors.replay.memory.model_recording import pop_snapshot
from actors.rank_actor import RankActor, ReplayRequest
from orchestrator.preflight import dedup
from orchestrator.reports import run_report as report
from orchestrator.run.aggregate import extension_summaries, summarize
from orchestrator.run.sinks import RunFiles, RunResult, default_sinks, file_sinks
from orchestrator.run_summary import ReplayedRun, RunFacts, RunSummary
from orchestrator.sinks import Sink, close_all, write_all
from orchestrator.config import RunConfig
from orchestrator.cluster.node_state import lost_nodes
from orchestrator.cluster.rank_result import Outcome
from orchestrator import interrupts
from orchestrator.run.phases import PhaseClock
from orchestrator.run.session import ReplaySession
from orchestrator.outputs import RunDir
from orchestrator.status import RunStatus
from actors.atomic_file import atomic_write

log = logging.getLogger("tracefleet")


def _failed_report(result) -> dict:
    """A rank that returned no report: its actor died, raised, hung, was aborted or was still
    running when a signal stopped the driver."""
    status = RunStatus.timeout if result.kind in (Outcome.timeout, Outcome.aborted) \
        else RunStatus.interrupted if result.kind == Outcome.interrupted else RunStatus.failed
    return FailureReport(rank=result.rank, status=status, error=result.error,
                         node_ip=result.node_ip, node_id=result.node_id).to_dict()


def run_replay(cfg: RunConfig, out_dir: Path, config_yaml: str | None = None, console=None,
               actor_cls=RankActor, session: ReplaySession | None = None,
               sinks: list[Sink[RunResult]] | None = None) -> dict:
    """Replay ``cfg.trace.dir`` on a Ray cluster; returns the summary (``RunSummary.to_dict``:
    the studies read its open-ended figures by name), handed to ``sinks``.

    ``actor_cls`` is the rank actor (tests substitute a subclass that misbehaves).
    ``session`` keeps Ray, the actors and pre-flight for the next replay (a sweep); without
    one, everything started here is stopped before returning. ``sinks`` (orchestrator/run/
    sinks.py) get the finished run; default: the files, the table and outputs listing on
    ``console``, the page with experiment.report; a search's probes pass ``file_sinks()``.
    A signal (KeyboardInterrupt) stops the run:
    the actors and the cluster are stopped as on any exit, ``summary.json`` gets status
    ``interrupted`` with the reports of the ranks that finished, and the exception goes on
    with a note saying so.
    """
    cfg.validate()
    if sinks is None:
        sinks = default_sinks(cfg.experiment.report, console)
    progress: dict = {}  # how far the run got: pre-flight's result, the ranks replayed
    try:
        return _run_replay(cfg, out_dir, config_yaml, actor_cls, session, sinks, progress)
    except KeyboardInterrupt as stop:
        try:
            _write_interrupted(stop, cfg, out_dir, config_yaml, progress)
        except Exception as exc:  # noqa: BLE001 (the signal is what the user must hear of)
            stop.add_note(f"no summary.json written ({type(exc).__name__}: {exc})")
        raise


def _write_interrupted(stop: KeyboardInterrupt, cfg: RunConfig, out_dir: Path,
                       config_yaml: str | None, progress: dict) -> None:
    """``summary.json`` (and ranks.csv) of a run a signal stopped, from what had finished."""
    pre, replayed = progress.get("pre"), progress.get("replayed")
    world_size = pre.world_size if pre is not None else cfg.experiment.world_size or 0
    results = getattr(stop, "results", None) or []
    for r in results:
        r.rank = replayed[r.rank]
    reports = [r.value if r.ok else _failed_report(r) for r in results]
    if reports and len(replayed) < world_size:
        reports = dedup.expand_reports(reports, replayed, pre.same_as)
    done = sum(1 for r in reports if r.get("status") != RunStatus.interrupted)
    summary = summarize(
        reports, world_size=world_size, run_status_override=RunStatus.interrupted,
        error=f"interrupted by {interrupts.name_of(stop)}",
        run=_facts(cfg, pre.ranks if pre is not None else None,
                   len(replayed) if replayed else 0))
    # the files alone: what a stopped run must leave (the console has the signal's line)
    RunFiles(plots=False).write(RunResult(summary, reports, out_dir, config_yaml))
    stop.add_note(f"{RunDir(out_dir).summary} has status interrupted, {done} of "
                  f"{world_size} rank(s) finished")


def _run_replay(cfg: RunConfig, out_dir: Path, config_yaml: str | None, actor_cls,
                session: ReplaySession | None, sinks: list[Sink[RunResult]],
                progress: dict) -> dict:
    """`run_replay`'s work, phase by phase (orchestrator/run/phases.py names them);
    ``progress`` records how far it got."""
    own_session = session is None
    session = session or ReplaySession()
    clock = PhaseClock()
    try:
        with clock.timed("cluster_start_s"):
            if cfg.cluster.address is not None:  # joined: pre-flight reduces in Ray tasks
                session.connect(cfg.cluster, cfg.experiment.world_size or 1)
        with clock.timed("preflight_s"):
            pre = session.preflight(cfg.trace.dir, cfg.experiment.world_size,
                                    cfg.trace.group_map, mode=str(cfg.replay.mode),
                                    ranks=cfg.trace.ranks,
                                    max_decompressed_bytes=cfg.trace.decompression_limit_bytes(),
                                    parsed_cache_dir=cfg.trace.parsed_cache_dir)
        progress["pre"] = pre
        if cfg.experiment.preflight_only:
            return _preflight_only(pre, cfg, out_dir, {"preflight_s": clock.seconds["preflight_s"]})
        # actor k replays rank replayed[k] (all ranks, or one per distinct trace: dedup.py)
        replayed = dedup.replayed_actors(pre, cfg.replay.mode, cfg.experiment.dedup_identical_ranks)
        progress["replayed"] = replayed
        results = _replay_ranks(cfg, out_dir, session, actor_cls, pre, replayed, clock)
    finally:
        with clock.timed("teardown_s"):
            if own_session:
                session.close()
    with clock.timed("aggregation_s"):
        rank_reports = _rank_reports(results, replayed, pre)
        clock.seconds.update(replay_phases(clock.seconds.pop("replay_window_s"),
                                           clock.seconds.pop("ship_s"), rank_reports))
        timings = clock.ordered()  # the summary's, completed below
        # replay.allocator_snapshot: files, not summary figures (a copy's report shares its
        # rank's)
        snapshots = {r["rank"]: pop_snapshot(r) for r in rank_reports
                     if r.get("replayed_as_rank", r["rank"]) == r["rank"]}
        summary = _summarize(cfg, pre, results, rank_reports, len(replayed), timings)
        result = RunResult(summary, rank_reports, out_dir, config_yaml, snapshots)
        write_all(sinks, result)
    timings["aggregation_s"] = clock.seconds["aggregation_s"]
    timings["total_s"] = clock.elapsed_s()
    log.info("timings: %s", ", ".join(f"{k} {v:.2f}" for k, v in timings.items()))
    close_all(sinks, result)  # summary.json again, now with every phase's time; the page
    return summary.to_dict()


def _replay_ranks(cfg: RunConfig, out_dir: Path, session: ReplaySession, actor_cls, pre,
                  replayed: list[int], clock: PhaseClock) -> list:
    """Start (or reuse) one actor per replayed rank, ship each its ReplayRequest, wait for
    every Result (bounded by experiment.replay_timeout_s), release the actors."""
    num_actors = len(replayed)
    with clock.timed("cluster_start_s"):
        session.connect(cfg.cluster, num_actors)
    with clock.timed("actor_start_s"):
        group = session.worker_group(actor_cls, num_actors, cfg.cluster,
                                     session.use_gpu(cfg.replay.device))
    results = None
    try:
        with clock.timed("actor_start_s"):
            if num_actors < pre.world_size:
                group.name_ranks(replayed, pre.world_size)
                log.info("replay.mode=compute: %d rank(s) with %d distinct trace(s), one "
                         "replay each", pre.world_size, num_actors)
        # the replay window: shipping the traces to the last report (replay_phases splits it)
        with clock.timed("replay_window_s"):
            with clock.timed("ship_s"):
                requests = _requests(cfg, out_dir, session, pre, replayed)
            refs = group.execute_async("replay", args_fn=lambda r: (requests[r],))
            results = group.wait(refs, timeout_s=cfg.experiment.replay_timeout_s,
                                 on_progress=_progress_printer(
                                     num_actors, cfg.experiment.progress_interval_s),
                                 failure_grace_s=cfg.experiment.failure_grace_s,
                                 is_failure=lambda report: report.get("status") != RunStatus.ok)
    finally:
        with clock.timed("teardown_s"):
            session.release(group, results, cfg.cluster.timeout_s)
    return results


def _requests(cfg: RunConfig, out_dir: Path, session: ReplaySession, pre,
              replayed: list[int]) -> list[ReplayRequest]:
    """Actor k's request: rank replayed[k]'s file (whose trace rank is
    pre.ranks[replayed[k]]), its bytes through the object store with trace.transfer so."""
    paths = [pre.sources[rank] for rank in replayed]
    blobs = [session.trace_blob(p) if cfg.trace.transfer == "object_store" else None
             for p in paths]
    profile_dir = str(out_dir / "profile") if cfg.replay.profile else None
    return [ReplayRequest(path, blob, cfg.replay, pre.process_groups, cfg.trace.group_map,
                          profile_dir, cfg.zero3, cfg.target) for path, blob in zip(paths, blobs)]


def _rank_reports(results: list, replayed: list[int], pre) -> list[dict]:
    """One report per rank: a Result's value, or a failure report for it; a deduplicated
    run's copies expanded (dedup.py)."""
    for r in results:  # a Result's rank is its actor's position: name the rank it replayed
        r.rank = replayed[r.rank]
    rank_reports = [r.value if r.ok else _failed_report(r) for r in results]
    if len(replayed) < pre.world_size:
        rank_reports = dedup.expand_reports(rank_reports, replayed, pre.same_as)
    return rank_reports


def _summarize(cfg: RunConfig, pre, results: list, rank_reports: list[dict], num_actors: int,
               timings: dict) -> RunSummary:
    """The run summary: the ranks aggregated, with the run's own facts."""
    return summarize(rank_reports, world_size=pre.world_size, error=lost_nodes(results),
                     run=_facts(cfg, pre.ranks, num_actors), replayed=ReplayedRun(
                         device_memory_capacity_bytes=_capacity(rank_reports),
                         timings_s=timings, preflight_warnings=pre.warnings,
                         machine_warnings=replay_machine_warnings(cfg.trace.dir, rank_reports,
                                                                  pre.ranks),
                         extensions=extension_summaries(rank_reports),
                         target=cfg.target.figures() if cfg.target.enabled else None))


def _facts(cfg: RunConfig, trace_ranks: list[int] | None, num_replays: int) -> RunFacts:
    """What the run was (every summary records it, an interrupted run's too)."""
    return RunFacts(experiment=cfg.experiment.name, trace_dir=str(cfg.trace.dir),
                    mode=cfg.replay.mode, allocation_mode=cfg.replay.allocation.mode,
                    trace_ranks=trace_ranks, num_replays=num_replays)


@contextmanager
def quiet_replays(session: ReplaySession | None = None):
    """A ``replay(cfg, out_dir) -> summary`` callable for searches and studies: replays that
    write their files and show nothing (``file_sinks``), on one ReplaySession (the given one,
    or one started here and closed on exit)."""
    own = session is None
    session = session or ReplaySession()
    try:
        yield lambda cfg, out_dir: run_replay(cfg, out_dir, session=session,
                                              sinks=file_sinks())
    finally:
        if own:
            session.close()


def _preflight_only(pre, cfg: RunConfig, out_dir: Path, timings: dict) -> dict:
    """``experiment.preflight_only``: pre-flight's result is the run's output; no actors."""
    summary = {"status": RunStatus.ok, "experiment": cfg.experiment.name,
               "trace_dir": str(cfg.trace.dir),
               "mode": str(cfg.replay.mode), **pre.to_dict(), "timings_s": timings}
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    atomic_write(RunDir(out_dir).preflight, orjson.dumps(pre.to_dict(), option=orjson.OPT_INDENT_2))
    report.write_summary(summary, out_dir)
    log.info("pre-flight only: %d rank(s) checked in %.2f s, %d warning(s)", pre.world_size,
             timings["preflight_s"], len(pre.warnings))
    return summary


def replay_phases(window_s: float, ship_s: float, rank_reports: list[dict]) -> dict:
    """Split the driver's replay window (from shipping the traces to the last report) into
    trace_load_s, rendezvous_s and replay_s, using the ranks' own ``timings_s``.

    Every rank waits in the rendezvous for the slowest loader, so the slowest rank's load
    (plus the driver's object-store put) is the load phase, the rendezvous phase ends when
    the last rank has its process groups, and the rest of the window is the replay. Ranks
    that sent no timings (failed before replaying) are left out.
    """
    ranks = [r["timings_s"] for r in rank_reports if r.get("timings_s")]
    load_s = max((t["trace_load_s"] for t in ranks), default=0.0)
    ready_s = max((t["trace_load_s"] + t["rendezvous_s"] for t in ranks), default=0.0)
    trace_load_s = min(ship_s + load_s, window_s)
    rendezvous_s = min(ready_s - load_s, window_s - trace_load_s)
    return {"trace_load_s": trace_load_s, "rendezvous_s": rendezvous_s,
            "replay_s": window_s - trace_load_s - rendezvous_s}


def _capacity(reports):
    caps = [r.get("device_memory_capacity_bytes") for r in reports if r.get("device_memory_capacity_bytes")]
    return min(caps) if caps else None


def _progress_printer(world_size: int, interval_s: float):
    start = time.monotonic()
    last = [start]

    def on_progress(num_done: int, *_):
        now = time.monotonic()
        if now - last[0] >= interval_s or num_done == world_size:
            last[0] = now
            log.info("replay: %d/%d ranks finished (%.0f s)", num_done, world_size, now - start)
    return on_progress
