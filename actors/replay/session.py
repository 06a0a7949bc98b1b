"""The one in-process replay of a rank: load its trace, build the engine with the caller's
extensions, run, close, report.

The rank actor (actors/rank_actor.py: between the load and the run it rebuilds the process
groups with actors/replay/comm/rank_comm.py), the predictor's dry run
(orchestrator/run/dry_run.py), the benchmarks and gpu_validate replay through ``RankSession``;
a caller that drives the engine itself (iteration by iteration) takes it from ``compile``.
No other file builds a ``ReplayEngine`` (tests/test_seams.py). The layers above the engine
bring their extensions as a factory ``extensions(trace) -> list`` (ZeRO-3's:
``actors.zero3.extension.zero3_extensions``), since this layer may not import them.
``phase`` and ``engine`` say where a failure happened (actors/replay/failure.py).
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

import torch

import actors.trace  # load_trace looked up at each call (tests wrap it)
from actors.replay.config import ReplayConfig
from actors.replay.engine import ReplayEngine
from actors.replay.memory.target import TargetConfig
from actors.trace.model import Trace

ExtensionFactory = Callable[[Trace], list]


class RankSession:
    """One rank's replay under ``cfg``; its stages are timed into ``timings_s``."""

    def __init__(self, cfg: ReplayConfig, *, rank: int = 0, device: torch.device | None = None,
                 target: TargetConfig | None = None, extensions: ExtensionFactory | None = None):
        self.cfg, self.rank, self.device, self.target = cfg, rank, device, target
        self._extensions = extensions
        self.phase = "load"  # what the rank is doing, named in a failure
        self.engine: ReplayEngine | None = None
        self.timings_s: dict[str, float] = {}

    @contextmanager
    def stage(self, phase: str, timing: str | None = None):
        """Enter ``phase`` (named in a failure inside it); its seconds go to
        ``timings_s[timing]`` when it ends without raising."""
        self.phase = phase
        start = time.perf_counter()
        yield
        if timing is not None:
            self.timings_s[timing] = time.perf_counter() - start

    def load(self, source, data: bytes | None = None, loader=None) -> Trace:
        """This rank's trace (``loader(source, rank=, data=)``: a cache's, else load_trace)."""
        with self.stage("load", "trace_load_s"):
            if loader is not None:
                return loader(source, rank=self.rank, data=data)
            return actors.trace.load_trace(source, rank=self.rank, data=data)

    def compile(self, trace: Trace, comm=None) -> ReplayEngine:
        """The engine of ``trace`` under this session's config, device, rank, target and
        extensions, its collectives through ``comm`` (`rank_comm`'s); the caller runs and
        closes it (``run`` does both)."""
        extra = self._extensions(trace) if self._extensions is not None else ()
        return ReplayEngine(trace, self.cfg, device=self.device, comm=comm, rank=self.rank,
                            target=self.target, extensions=extra)

    def run(self, trace: Trace, comm=None, profile_path: Path | None = None) -> dict:
        """Compile (the engine's plan and its extensions'), run every iteration (under the
        torch profiler when ``profile_path`` is given), close the engine: the report's dict."""
        with self.stage("compile"):
            self.engine = self.compile(trace, comm)
        with self.stage("iteration"):
            try:
                report = _profiled(self.engine, profile_path) if profile_path \
                    else self.engine.run()
            finally:
                self.engine.close()  # the CPU memory meter gives torch its allocator back
        self.phase = "report"
        return report.to_dict()


def replay_rank(source, cfg: ReplayConfig, *, rank: int | None = None,
                target: TargetConfig | None = None,
                extensions: ExtensionFactory | None = None) -> dict:
    """Load, compile, run and close one rank's replay of ``source`` in this process (no
    process groups: compute mode); the report's dict. ``rank`` None: the file name's (the
    engine's rank 0). Raises what the replay raised."""
    session = RankSession(cfg, rank=rank or 0, target=target, extensions=extensions)
    trace = actors.trace.load_trace(source) if rank is None else session.load(source)
    return session.run(trace)


def _profiled(engine: ReplayEngine, path: Path):
    """``engine.run()`` under the torch profiler, its chrome trace written to ``path``."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU]
    if engine.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    path.parent.mkdir(parents=True, exist_ok=True)
    with profile(activities=activities) as prof:
        report = engine.run()
    prof.export_chrome_trace(str(path))
    return report
