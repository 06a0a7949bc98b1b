"""The original run of a capture, timed again on this machine, now (actors/capture/eager.py).

A time ratio against the timings in a capture's meta.json compares measurements taken on
another machine or hours apart; ``OriginalWorkload`` rebuilds the capture workload meta.json
names (same config, same world size, same threads per rank) on its own worker group, so the
original and a replay can be timed alternately in one run (scripts/bench_fidelity.py).
"""
from __future__ import annotations

import ray

from actors.capture.eager import EagerActor
from actors.capture.request import CaptureRequest
from actors.errors import ConfigError
from orchestrator.config import ClusterConfig
from orchestrator.errors import ClusterError
from orchestrator.run.aggregate import slowest_series_s
from orchestrator.cluster.worker_group import WorkerGroup

BUILD_TIMEOUT_S = 600.0  # a cold DeepSpeed start included


class OriginalWorkload:
    """Context manager: the capture workload of ``meta`` (a meta.json dict) built and warmed
    up on ``meta["world_size"]`` rank actors of the connected Ray cluster."""

    def __init__(self, meta: dict, cluster: ClusterConfig | None = None,
                 timeout_s: float = BUILD_TIMEOUT_S):
        if not meta.get("workload") or not meta.get("world_size"):
            raise ConfigError("meta.json names no capture workload (workload, world_size): "
                              "re-capture it with tracefleet-capture")
        threads = max(int(r.get("num_threads") or 0) for r in meta.get("ranks") or [{}])
        # meta.json's plain values become the typed request here, once (Ray pickles it)
        self.request = CaptureRequest.from_dict(
            {"workload": meta["workload"], "warmup_iters": meta.get("warmup_iters", 3),
             "num_threads": threads, "dist_timeout_s": timeout_s})
        self.timeout_s = timeout_s
        self.group = WorkerGroup(ray.remote(EagerActor), meta["world_size"],
                                 cluster or ClusterConfig(),
                                 use_gpu=meta["workload"].get("device") == "cuda")

    def __enter__(self) -> "OriginalWorkload":
        self.group.start()
        try:
            self._values(self.group.run("build", self.request, timeout_s=self.timeout_s), "build")
        except BaseException:
            self.group.shutdown()
            raise
        return self

    def time(self, num_iters: int) -> list[float]:
        """``num_iters`` more training iterations: the slowest rank's time per iteration."""
        times = self._values(self.group.run("time_iterations", num_iters,
                                            timeout_s=self.timeout_s), "timing")
        return slowest_series_s([{"iteration_times_s": t} for t in times])

    def __exit__(self, *exc) -> None:
        try:
            self.group.run("close", timeout_s=30)
        finally:
            self.group.shutdown()

    @staticmethod
    def _values(results, what: str) -> list:
        bad = [f"rank {r.rank} {r.kind}: {r.error}" for r in results if not r.ok]
        if bad:
            raise ClusterError(f"original workload {what} failed: {'; '.join(bad)}")
        return [r.value for r in results]
