"""A group of rank actors on one Ray placement group, ordered and wired like Ray Train.

One bundle per rank is reserved atomically, one actor is pinned to each bundle, ranks are
ordered by node (the driver's node first, then by IP) and by GPU id within a node, and each
actor gets RANK/LOCAL_RANK/WORLD_SIZE/LOCAL_WORLD_SIZE/NODE_RANK/MASTER_ADDR/MASTER_PORT.
"""
from __future__ import annotations

import ipaddress
import logging
import time
from typing import Any, Callable

import ray
from ray.exceptions import RayError
from ray.util.placement_group import remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from orchestrator.config import ClusterConfig
from orchestrator.errors import ClusterError
from orchestrator.cluster.placement import reserve_bundles
from orchestrator.cluster.rank_result import Outcome, Result, failure_text, outcome

KILL_WAIT_S = 10.0  # how long shutdown waits for its killed actors to be gone

log = logging.getLogger(__name__)


class WorkerGroup:
    """``world_size`` actors of ``actor_cls`` (a RankWorkerBase subclass), one per bundle."""

    def __init__(self, actor_cls, world_size: int, cfg: ClusterConfig, use_gpu: bool = False,
                 actor_kwargs: dict | None = None):
        if world_size < 1:
            raise ClusterError(f"world_size={world_size}: expected >= 1")
        cfg.validate()
        self._remote_cls = (actor_cls if isinstance(actor_cls, ray.actor.ActorClass)
                            else ray.remote(actor_cls))
        self.world_size = world_size
        self.cfg = cfg
        self.use_gpu = use_gpu
        self.actor_kwargs = actor_kwargs or {}
        self.workers: list = []  # actor handles in rank order
        self.node_infos: list[dict] = []  # node_info() of each rank, in rank order
        self.master_addr: str | None = None
        self.master_port: int | None = None
        self._actors: list = []  # every actor created, in bundle order (for shutdown)
        self._dead: list = []  # actors seen dead by wait(): not asked to shut down
        self._pg = None

    @property
    def bundle(self) -> dict:
        """The resources reserved for one rank."""
        if self.use_gpu:
            return {"GPU": 1, "CPU": self.cfg.cpus_per_rank}
        return {"CPU": self.cfg.cpus_per_rank}

    @property
    def placement_group(self):
        """The group's Ray PlacementGroup (None before start() and after shutdown())."""
        return self._pg

    def start(self) -> "WorkerGroup":
        """Reserve the bundles, start the actors, order the ranks and export their env.

        Each phase is bounded by cfg.timeout_s; on failure everything is released and
        ClusterError is raised.
        """
        try:
            self._pg = reserve_bundles(self.bundle, self.world_size,
                                       str(self.cfg.placement_strategy), self.cfg.timeout_s)
            options = {"num_cpus": self.cfg.cpus_per_rank, "num_gpus": 1 if self.use_gpu else 0}
            for index in range(self.world_size):
                strategy = PlacementGroupSchedulingStrategy(
                    placement_group=self._pg, placement_group_bundle_index=index)
                self._actors.append(self._remote_cls.options(
                    scheduling_strategy=strategy, **options).remote(**self.actor_kwargs))
            infos = self._gather([a.node_info.remote() for a in self._actors], "start")
            order = rank_order(infos, ray.get_runtime_context().get_node_id())
            self.workers = [self._actors[i] for i in order]
            self.node_infos = [infos[i] for i in order]
            self.master_addr = self.node_infos[0]["node_ip"]
            self.master_port = self._gather([self.workers[0].find_free_port.remote()],
                                            "find a free port on rank 0")[0]
            envs = rank_envs(self.node_infos)
            if self.use_gpu:
                for env, devices in zip(envs, shared_visible_devices(self.node_infos)):
                    env.update(devices)
            self._setup(envs, "set up")
        except BaseException:
            self.shutdown(graceful_timeout_s=0)
            raise
        log.info("worker group of %d ranks on %d node(s), master %s:%d", self.world_size,
                 len({i["node_id"] for i in self.node_infos}), self.master_addr,
                 self.master_port)
        return self

    def rewire(self) -> None:
        """A fresh MASTER_PORT for the next rendezvous (the previous store's port may still be
        in TIME_WAIT), exported to every rank; ClusterError past cfg.timeout_s."""
        self.master_port = self._gather([self.workers[0].find_free_port.remote()],
                                        "find a free port on rank 0")[0]
        self._setup(rank_envs(self.node_infos), "set up")

    def name_ranks(self, ranks: list[int], world_size: int) -> None:
        """Give actor k the rank ``ranks[k]`` of a ``world_size`` world (RANK/WORLD_SIZE), so
        its report, errors and profile file name the rank it stands for (one actor per
        distinct trace: orchestrator/preflight/dedup.py; no rendezvous follows);
        ClusterError past cfg.timeout_s."""
        envs = rank_envs(self.node_infos)
        for env, rank in zip(envs, ranks):
            env.update(rank=rank, world_size=world_size)
        self._setup(envs[:len(ranks)], "take their rank")

    def release(self, timeout_s: float) -> bool:
        """Ask every rank to ``shutdown()`` (destroy its process groups), keeping the actors
        for another call; whether all of them did within ``timeout_s``."""
        refs = [w.shutdown.remote() for w in self.workers]
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        if len(done) < len(refs):
            return False
        try:
            ray.get(refs)
            return True
        except RayError as exc:
            log.warning("rank actors failed to release their process groups: %s", exc)
            return False

    def _setup(self, envs: list[dict], what: str) -> None:
        """Export ``envs`` (one per rank, in rank order) and the master's address to the
        ranks."""
        self._gather([w.setup.remote(**env, master_addr=self.master_addr,
                                     master_port=self.master_port)
                      for w, env in zip(self.workers, envs)], what)

    def execute_async(self, method: str, *args, args_fn: Callable[[int], tuple] | None = None,
                      **kwargs) -> list:
        """Call ``method`` on every rank; return the object refs in rank order.

        Every rank gets ``*args`` and ``**kwargs``, or ``*args_fn(rank)`` (plus kwargs)
        when ``args_fn`` is given.
        """
        if not self.workers:
            raise ClusterError("the worker group is not started (call start())")
        return [getattr(w, method).remote(*(args_fn(rank) if args_fn else args), **kwargs)
                for rank, w in enumerate(self.workers)]

    def run(self, method: str, *args, timeout_s: float,
            args_fn: Callable[[int], tuple] | None = None, **kwargs) -> list[Result]:
        """``wait(execute_async(...), timeout_s)`` with the default grace and polling."""
        return self.wait(self.execute_async(method, *args, args_fn=args_fn, **kwargs),
                         timeout_s)

    def wait(self, refs: list, timeout_s: float, poll_s: float = 1.0,
             on_progress: Callable[[int, int, float], None] | None = None,
             failure_grace_s: float = 10.0,
             is_failure: Callable[[Any], bool] | None = None) -> list[Result]:
        """Collect one Result per rank (refs in rank order); never raises for a rank.

        A failure is seen within ``poll_s``; the ranks still running then get
        ``failure_grace_s`` more (they may be blocked in a collective with the failed
        rank) before they are reported 'aborted'. Ranks not done by ``timeout_s`` are
        'timeout'. ``on_progress(num_done, num_total, elapsed_s)`` is called every poll.
        A group with a non-ok rank is in an unknown state: shut it down. A KeyboardInterrupt
        (a signal) leaves with ``.results``: the ranks done so far, the others 'interrupted'.
        ``is_failure(value)`` marks a returned value as a failure too (a rank that reports
        its own failure instead of raising), starting the same grace period.
        """
        start = time.monotonic()
        deadline = start + timeout_s
        results: list[Result | None] = [None] * len(refs)
        pending = {ref: rank for rank, ref in enumerate(refs)}
        first_failure: Result | None = None
        grace_end = float("inf")
        try:
            while pending:
                limit = min(deadline, grace_end)
                now = time.monotonic()
                if now >= limit:
                    break
                ready, _ = ray.wait(list(pending), num_returns=len(pending),
                                    timeout=min(poll_s, limit - now))
                for ref in ready:
                    rank = pending.pop(ref)
                    results[rank] = outcome(rank, ref)
                    failed = not results[rank].ok or (is_failure is not None and
                                                      is_failure(results[rank].value))
                    if failed and first_failure is None:
                        first_failure = results[rank]
                        grace_end = time.monotonic() + failure_grace_s
                if on_progress is not None:
                    on_progress(len(refs) - len(pending), len(refs), time.monotonic() - start)
        except KeyboardInterrupt as stop:  # a signal: what finished so far rides on it
            for rank, result in enumerate(results):
                if result is None:
                    results[rank] = Result(rank, Outcome.interrupted, error=(
                        f"rank {rank} still running when the driver was interrupted"))
            stop.results = self._named(results)
            raise
        for rank in pending.values():
            if first_failure is not None and time.monotonic() < deadline:
                results[rank] = Result(rank, Outcome.aborted, error=(
                    f"rank {rank} still running {failure_grace_s:.1f} s after rank "
                    f"{first_failure.rank} failed ({first_failure.kind})"))
            else:
                results[rank] = Result(rank, Outcome.timeout, error=(
                    f"rank {rank} did not finish within {timeout_s:.1f} s"))
        return self._named(results)

    def _named(self, results: list[Result]) -> list[Result]:
        """``results`` with each rank's node (a lost node is the usual cause of a failure);
        dead actors are remembered (never asked to shut down)."""
        for result in results:
            info = self.node_infos[result.rank] if result.rank < len(self.node_infos) else {}
            result.node_ip, result.node_id = info.get("node_ip"), info.get("node_id")
            if result.kind == Outcome.died and result.rank < len(self.workers):
                self._dead.append(self.workers[result.rank])
        return results

    def shutdown(self, graceful_timeout_s: float = 5.0) -> None:
        """Ask every actor to ``shutdown()`` (bounded), kill them all, free the bundles."""
        alive = [a for a in self._actors if a not in self._dead]  # a dead one never answers
        if alive and graceful_timeout_s > 0:
            refs = [a.shutdown.remote() for a in alive]
            ray.wait(refs, num_returns=len(refs), timeout=graceful_timeout_s)
        for actor in self._actors:
            ray.kill(actor, no_restart=True)
        _await_gone(self._actors, KILL_WAIT_S)
        if self._pg is not None:
            remove_placement_group(self._pg)
        self._actors, self.workers, self._dead, self._pg = [], [], [], None

    def __enter__(self) -> "WorkerGroup":
        return self if self.workers else self.start()

    def __exit__(self, *exc_info) -> None:
        self.shutdown()

    def _gather(self, refs: list, what: str) -> list:
        """ray.get bounded by cfg.timeout_s, turning actor failures into ClusterError."""
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.cfg.timeout_s)
        if len(ready) < len(refs):
            raise ClusterError(f"{len(refs) - len(ready)} of {len(refs)} rank actors did not "
                               f"{what} within cluster.timeout_s={self.cfg.timeout_s:.1f} s")
        try:
            return ray.get(refs)
        except RayError as exc:
            raise ClusterError(f"rank actors failed to {what}: {failure_text(exc)}") from exc


def _await_gone(actors: list, timeout_s: float) -> None:
    """Return once every killed actor refuses a call, or after ``timeout_s``: ``ray.kill`` is
    sent asynchronously, and a call made at once could still reach the actor (seen on a loaded
    machine: a shut-down group's actor answered a ping)."""
    deadline = time.monotonic() + timeout_s
    for actor in actors:
        while (left := deadline - time.monotonic()) > 0:
            try:
                ray.get(actor.__ray_ready__.remote(), timeout=left)
            except RayError:  # gone (or out of time: the bound ends the wait either way)
                break
            time.sleep(0.05)


def rank_order(infos: list[dict], first_node_id: str | None = None) -> list[int]:
    """Bundle indices in rank order: node by node (``first_node_id`` first, then by IP and
    node id), and by GPU id then bundle index within a node, as Ray Train does."""
    def key(index: int):
        info = infos[index]
        gpus = [int(g) for g in info["gpu_ids"] if str(g).isdigit()]
        return (info["node_id"] != first_node_id, _ip_key(info["node_ip"]), info["node_id"],
                min(gpus) if gpus else -1, index)
    return sorted(range(len(infos)), key=key)


def rank_envs(infos: list[dict]) -> list[dict]:
    """rank/local_rank/world_size/local_world_size/node_rank for infos in rank order."""
    node_ranks: dict[str, int] = {}
    node_sizes: dict[str, int] = {}
    for info in infos:
        node_ranks.setdefault(info["node_id"], len(node_ranks))
        node_sizes[info["node_id"]] = node_sizes.get(info["node_id"], 0) + 1
    envs, seen = [], {}
    for rank, info in enumerate(infos):
        node = info["node_id"]
        envs.append({"rank": rank, "local_rank": seen.get(node, 0), "world_size": len(infos),
                     "local_world_size": node_sizes[node], "node_rank": node_ranks[node]})
        seen[node] = seen.get(node, 0) + 1
    return envs


def shared_visible_devices(infos: list[dict]) -> list[dict]:
    """Per rank (infos in rank order): every GPU of its node visible, as Ray Train's torch
    backend does (``share_cuda_visible_devices``), and the rank's own GPU's index among them.

    Ray isolates each GPU actor to its own device; NCCL then cannot use peer-to-peer inside
    the node and takes slower paths, which would distort the comms figures.
    """
    node_gpus: dict[str, list[str]] = {}
    for info in infos:
        node_gpus.setdefault(info["node_id"], []).extend(str(g) for g in info["gpu_ids"])
    for node, gpus in node_gpus.items():
        node_gpus[node] = sorted(set(gpus), key=lambda g: (not g.isdigit(), int(g) if g.isdigit() else 0, g))
    out = []
    for info in infos:
        gpus = node_gpus[info["node_id"]]
        own = str(info["gpu_ids"][0]) if info["gpu_ids"] else None
        out.append({"cuda_visible_devices": ",".join(gpus),
                    "device_index": gpus.index(own) if own is not None else None})
    return out


def _ip_key(ip: str) -> tuple:
    try:
        addr = ipaddress.ip_address(ip)
        return (addr.version, addr.packed)
    except ValueError:  # a hostname: order it after every IP, by name
        return (99, ip.encode())
