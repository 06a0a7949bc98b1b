"""``tracefleet-predict``'s dry run: one replay per distinct rank trace, no Ray: in this process,
or several at once in local worker processes.

Ranks whose trace files are byte-identical replay once (pre-flight's grouping,
orchestrator/preflight/trace_identity.py, which streams the files): on meta and fake every
rank's trace is rank 0's, so one replay stands for the whole job. Each replay is
actors/replay/session.py's, with the ZeRO-3 emulation's extensions when it is given. The
prediction's config and verdict are orchestrator/studies/predict.py's.
"""
from __future__ import annotations

import os

from actors.errors import TracefleetError
from actors.gc_pause import gc_paused
from actors.replay.config import ReplayConfig
from actors.replay.memory.target import TargetConfig
from actors.zero3.config import Zero3Config
from orchestrator.cluster.worker_pool import WorkerDied, in_fresh_processes
from orchestrator.preflight.trace_identity import identical_groups
from orchestrator.status import ANSWERED
from actors.replay.session import replay_rank
from actors.zero3.extension import zero3_extensions


def dry_run(sources: dict, replay: ReplayConfig, target: TargetConfig,
            zero3: Zero3Config | None, num_workers: int = 1
            ) -> tuple[dict[int, list[int]], dict[int, dict]]:
    """``(groups, reports)``: the ranks of ``sources`` (rank -> TraceSource) grouped by
    identical trace (``{representative: [ranks]}``) and each representative's report.
    ``num_workers`` > 1: that many distinct traces dry-run at once, each in a spawned process
    of its own (a pipeline's stages: minutes each at 405B); 0: as many as this machine's
    CPUs; 1: one after another here."""
    groups = identical_groups(sources)
    reps = list(groups)
    workers = min(len(reps), num_workers or os.cpu_count() or 1)
    if workers > 1:
        results = in_fresh_processes(dry_run_rank, [(sources[rep], rep, replay, target, zero3)
                                                    for rep in reps], workers)
        try:
            return groups, {rep: next(results) for rep in reps}
        except WorkerDied as exc:
            raise TracefleetError(f"the process dry-running {sources[reps[exc.index]]} ended "
                                  f"without a result (exit code {exc.exitcode}: killed by the "
                                  "kernel, out of memory?); dry-run fewer at once") from None
    _import_dynamo()
    reports = {rep: dry_run_rank(sources[rep], rep, replay, target, zero3) for rep in groups}
    return groups, reports


def _import_dynamo() -> None:
    """Import ``torch._dynamo`` here, before any replay. Its first import comes from inside an
    op (``torch._refs`` -> ``torch._compile``), and torch.fx's ``wrap`` then keeps its own frame
    in a reference cycle whose ``f_back`` chain holds the replay's frames. With the GC off (the
    predict command's), that kept the first replay's trace and engine to the end (1.2 GB on a
    405B stage)."""
    import torch._dynamo  # noqa: F401


def dry_run_rank(source, rank: int, replay: ReplayConfig, target: TargetConfig,
                 zero3: Zero3Config | None) -> dict:
    """One rank's meta dry run with the allocator model (and the ZeRO-3 emulation); a
    TracefleetError when it did not end with an answer (ok, or an OOM)."""
    # One GC pause over the load, the compile and the run (each pauses it on its own): between
    # them, and after them while the trace is still referenced, the collector would wake to a
    # young generation of the trace's million objects and rescan it (about 1 s of a 70B
    # probe's 6). The trace and the engine are freed by reference counting inside the pause
    # (replay_rank's frame ends first); cycles made meanwhile are collected after it.
    with gc_paused():
        report = replay_rank(source, replay, rank=rank, target=target,
                             extensions=lambda trace: zero3_extensions(zero3, trace))
    if report["status"] not in ANSWERED:
        raise TracefleetError(f"the dry run of {source} failed: {report['error']}")
    return report
