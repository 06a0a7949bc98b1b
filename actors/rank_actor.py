"""The Ray actor of one rank: load its trace, rebuild the process groups, replay, report."""
from __future__ import annotations

import hashlib
import os
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from actors.errors import TracefleetError, describe
from actors.machine import machine_info
from actors.rank_base import RankWorkerBase
from actors.replay.comm.replayer import CollectiveReplayer
from actors.replay.config import ReplayConfig
from actors.replay.engine import ReplayEngine, pick_device
from actors.replay.memory.accounting import OutOfMemory
from actors.replay.comm.process_groups import ProcessGroups
from actors.replay.memory.target import TargetConfig
from actors.trace import load_trace
from actors.zero3.config import Zero3Config
from actors.zero3.extension import zero3_extensions


class RankActor(RankWorkerBase):
    """One rank of a replay. The driver wraps it with ``ray.remote`` and pins it to a bundle."""

    _trace_cache: tuple | None = None  # (file version, Trace) of the last load

    def replay(self, trace_path: str, trace_bytes, cfg: ReplayConfig, pg_table: list,
               group_map: dict | None = None, profile_dir: str | None = None,
               zero3: Zero3Config | None = None, target: TargetConfig | None = None) -> dict:
        """Replay this rank's trace (under ZeRO-3 emulation when ``zero3`` picks a strategy,
        predicting reserved memory when ``target`` names a CUDA device); never raises:
        failures come back as a report with a status."""
        rank = int(os.environ["RANK"])
        world_size = int(os.environ["WORLD_SIZE"])
        engine, phase = None, "load"  # what the rank was doing, named in a failure
        try:
            device = pick_device(cfg.device, self.device_index)
            if device.type == "cuda":
                torch.cuda.set_device(device)
            t0 = time.perf_counter()
            trace = self._load(trace_path, rank, trace_bytes)
            t1 = time.perf_counter()
            phase = "rendezvous"
            comm = None
            if cfg.mode != "compute":
                backend = "nccl" if device.type == "cuda" else "gloo"
                dist.init_process_group(backend, rank=rank, world_size=world_size,
                                        timeout=timedelta(seconds=cfg.collective_timeout_s))
                groups = ProcessGroups.create(pg_table, rank, world_size, backend,
                                              cfg.collective_timeout_s, group_map)
                comm = CollectiveReplayer(groups, device, ops=trace.ops,
                                          cuda_sync_timing=cfg.cuda_sync_collectives)
            t2 = time.perf_counter()
            phase = "compile"  # the engine's plan, and its extensions' (a ZeRO-3 plan)
            engine = ReplayEngine(trace, cfg, device=device, comm=comm, rank=rank, target=target,
                                  extensions=zero3_extensions(zero3, trace))
            phase = "iteration"
            try:
                if profile_dir:
                    path = Path(profile_dir) / f"rank-{rank}.pt.trace.json"
                    report = self._profiled(engine, path)
                else:
                    report = engine.run()
            finally:
                engine.close()  # the CPU memory meter gives torch its allocator back
            phase = "report"
            out = report.to_dict()
            out["machine"] = machine_info()  # the driver compares it with the capture's
            # The driver splits its replay window with these (launch.replay_phases).
            out["timings_s"] = {"trace_load_s": t1 - t0, "rendezvous_s": t2 - t1,
                                "replay_s": time.perf_counter() - t2}
            return {**out, **self._where()}
        except Exception as e:  # the driver needs a report from every rank, whatever happened
            return self._failure(rank, engine, e, phase)

    def _load(self, trace_path: str, rank: int, trace_bytes):
        """This rank's trace, parsed once per file version: a sweep's later points reuse it
        (the replay never modifies a Trace). Keyed by size and mtime, or by the shipped bytes."""
        if trace_bytes is None:
            st = os.stat(trace_path)
            key = (trace_path, rank, st.st_size, st.st_mtime_ns)
        else:
            key = (trace_path, rank, hashlib.blake2b(trace_bytes, digest_size=16).digest())
        if self._trace_cache is None or self._trace_cache[0] != key:
            self._trace_cache = (key, load_trace(trace_path, rank=rank, data=trace_bytes))
        return self._trace_cache[1]

    def _where(self) -> dict:
        """The node this rank ran on (two nodes may share an IP: the node id tells them apart)."""
        info = self.node_info()
        return {"node_ip": info["node_ip"], "node_id": info["node_id"]}

    @staticmethod
    def _profiled(engine, path: Path):
        from torch.profiler import ProfilerActivity, profile
        activities = [ProfilerActivity.CPU]
        if engine.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        path.parent.mkdir(parents=True, exist_ok=True)
        with profile(activities=activities) as prof:
            report = engine.run()
        prof.export_chrome_trace(str(path))
        return report

    def _failure(self, rank: int, engine, e: Exception, phase: str) -> dict:
        op = engine.last_op if engine is not None else None
        last = f"node {op.node_id} {op.name}" if op is not None else None
        timed_out = "timed out" in str(e).lower() or "timeout" in type(e).__name__.lower()
        # before the first op: e.g. ZeRO-3 shards that do not fit the device capacity
        oom = isinstance(e, OutOfMemory)
        detail = "" if isinstance(e, (TracefleetError, OutOfMemory)) else \
            "\n" + traceback.format_exc(limit=6)
        status = "oom" if oom else "timeout" if timed_out else "failed"
        text = f"out of memory before the first op: {e}" if oom else describe(e, phase, op)
        return {"rank": rank, **self._where(), "status": status, "error": f"rank {rank}: {text}",
                "oom": {"node_id": None, "op": None, "held_bytes": e.held_bytes,
                        "requested_bytes": e.requested_bytes} if oom else None,
                "last_op": last, "phase": phase, "traceback": detail or None}
