"""The Ray actor of one rank: load its trace, rebuild the process groups, replay, report."""
from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import ray
import torch
import torch.distributed as dist

from actors.machine import machine_info
from actors.rank_base import RankWorkerBase
from actors.replay.comm.rank_comm import backend_for, rank_comm
from actors.replay.config import ReplayConfig
from actors.replay.engine import pick_device
from actors.replay.failure import FailureReport
from actors.replay.session import RankSession
from actors.replay.memory.target import TargetConfig
from actors.trace import load_trace
from actors.zero3.config import Zero3Config
from actors.zero3.extension import Zero3Extension, zero3_extensions

#: the extensions a rank adds to the engine's own (actors/replay/extension_list.py), whose report
#: parts the driver summarizes over the ranks, each by its own ``summarize_ranks``
RANK_EXTENSIONS = (Zero3Extension,)


@dataclass(frozen=True)
class ReplayRequest:
    """What the driver asks one rank to replay (orchestrator/run/launch.py sends one per
    actor)."""

    trace_path: str  # the rank's trace file (or archive member path: actors/trace/source.py)
    trace_bytes: object  # its stored bytes, or their object-store ref, when shipped; else None
    cfg: ReplayConfig
    pg_table: list  # the merged process-group table (pre-flight's)
    group_map: dict | None = None  # trace.group_map: collectives without a group name
    profile_dir: str | None = None  # replay.profile: the torch profiler's trace goes here
    zero3: Zero3Config | None = None
    target: TargetConfig | None = None


class RankActor(RankWorkerBase):
    """One rank of a replay. The driver wraps it with ``ray.remote`` and pins it to a bundle."""

    _trace_cache: tuple | None = None  # (file version, Trace) of the last load

    def replay(self, request: ReplayRequest) -> dict:
        """Replay this rank's trace (under ZeRO-3 emulation when ``request.zero3`` picks a
        strategy, predicting reserved memory when ``request.target`` names a CUDA device);
        never raises: failures come back as a report with a status (actors/replay/failure.py)."""
        trace_path, cfg = request.trace_path, request.cfg
        zero3, profile_dir = request.zero3, request.profile_dir
        trace_bytes = request.trace_bytes
        if isinstance(trace_bytes, ray.ObjectRef):  # Ray resolves only top-level arguments
            trace_bytes = ray.get(trace_bytes)
        rank = int(os.environ["RANK"])
        world_size = int(os.environ["WORLD_SIZE"])
        session = RankSession(cfg, rank=rank, target=request.target,
                              extensions=lambda trace: zero3_extensions(zero3, trace))
        try:
            session.device = device = pick_device(cfg.device, self.device_index)
            if device.type == "cuda":
                torch.cuda.set_device(device)
            trace = session.load(trace_path, trace_bytes, loader=self._load)
            comm = None
            with session.stage("rendezvous", "rendezvous_s"):
                if cfg.mode != "compute":
                    dist.init_process_group(backend_for(device), rank=rank,
                                            world_size=world_size,
                                            timeout=timedelta(seconds=cfg.collective_timeout_s))
                    comm = rank_comm(request.pg_table, rank, world_size, device,
                                     timeout_s=cfg.collective_timeout_s,
                                     group_map=request.group_map, ops=trace.ops,
                                     cuda_sync_timing=cfg.cuda_sync_collectives)
            t2 = time.perf_counter()
            profile = Path(profile_dir) / f"rank-{rank}.pt.trace.json" if profile_dir else None
            out = session.run(trace, comm, profile)
            out["machine"] = machine_info()  # the driver compares it with the capture's
            # The driver splits its replay window with these (launch.replay_phases).
            out["timings_s"] = {**session.timings_s, "replay_s": time.perf_counter() - t2}
            return {**out, **self._where()}
        except Exception as e:  # the driver needs a report from every rank, whatever happened
            op = session.engine.last_op if session.engine is not None else None
            return FailureReport.of_rank(rank, e, session.phase, op, self._where()).to_dict()

    def _load(self, trace_path: str, rank: int, data):
        """This rank's trace, parsed once per file version: a sweep's later points reuse it
        (the replay never modifies a Trace). Keyed by size and mtime, or by the shipped bytes."""
        if data is None:
            st = os.stat(trace_path)
            key = (trace_path, rank, st.st_size, st.st_mtime_ns)
        else:
            key = (trace_path, rank, hashlib.blake2b(data, digest_size=16).digest())
        if self._trace_cache is None or self._trace_cache[0] != key:
            self._trace_cache = (key, load_trace(trace_path, rank=rank, data=data))
        return self._trace_cache[1]

    def _where(self) -> dict:
        """The node this rank ran on (two nodes may share an IP: the node id tells them apart)."""
        info = self.node_info()
        return {"node_ip": info["node_ip"], "node_id": info["node_id"]}
