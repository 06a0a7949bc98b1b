"""The machine a rank runs on, as far as its timing depends on it.

Capture records it per rank in meta.json; a replay reports its own, and the driver warns when
they differ: a time ratio against an original measured on another CPU, or with another number
of threads per rank, says more about the machines than about the replay.
"""
from __future__ import annotations

import os
import platform
from pathlib import Path

from actors.errors import TraceError
from actors.trace.meta_file import meta_path_of, read_meta

FIELDS = ("cpu_model", "num_cpus", "num_threads", "gpu")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith(("model name", "hardware", "cpu model")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def machine_info() -> dict:
    """``{cpu_model, num_cpus, num_threads, gpu}`` of this process (threads: torch's intra-op
    threads; gpu: the current CUDA device's name, or None)."""
    import torch

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return {"cpu_model": _cpu_model(), "num_cpus": os.cpu_count(),
            "num_threads": torch.get_num_threads(), "gpu": gpu}


def differences(captured: dict, replayed: dict) -> list[str]:
    """``field: captured -> replayed`` for every field both know and that differs."""
    return [f"{k}: {captured[k]!r} at capture, {replayed[k]!r} here" for k in FIELDS
            if k in captured and k in replayed and captured[k] != replayed[k]]


def replay_machine_warnings(trace_dir, rank_reports: list[dict],
                            trace_ranks: list[int] | None = None) -> list[str]:
    """One warning per set of ranks whose machine differs from the one its trace was captured on
    (per rank ``machine`` in the ``meta.json`` beside the traces; replay rank r replays trace
    rank ``trace_ranks[r]``, r itself without it); a meta.json that records no machine
    (captured before it did) gets one warning saying the two cannot be compared."""
    meta_path = meta_path_of(str(trace_dir))
    try:  # bounded; pre-flight checked its per-rank fields (meta_file.check_ranks)
        meta = read_meta(meta_path) if Path(str(trace_dir)).is_dir() else None
    except TraceError:
        meta = None
    if meta is None:
        return []  # not a capture folder: nothing to compare with
    captured = {r.get("rank"): r.get("machine") for r in meta.get("ranks") or []
                if isinstance(r, dict)}
    if not any(captured.values()):
        return [f"{meta_path} records no capture machine: time ratios against its timings "
                "cannot tell a slower replay from a slower machine"]
    by_diff: dict[str, list] = {}  # ranks with the same differences share one line
    for report in rank_reports:
        rank = report.get("rank")
        if trace_ranks is not None and isinstance(rank, int) and rank < len(trace_ranks):
            rank = trace_ranks[rank]
        before, now = captured.get(rank), report.get("machine")
        diff = differences(before, now) if before and now else []
        if diff:
            by_diff.setdefault("; ".join(diff), []).append(report["rank"])
    warnings = []
    for diff, ranks in by_diff.items():
        one = len(ranks) == 1
        warnings.append(f"{_ranks_text(ranks)} on another machine than "
                        f"{'it was' if one else 'they were'} captured on ({diff}): "
                        f"{'its time is' if one else 'their times are'} not the original's")
    return warnings


def _ranks_text(ranks: list) -> str:
    """``rank 3 replays`` or ``ranks 0-1023, 1025 replay`` (runs of consecutive ranks)."""
    if len(ranks) == 1:
        return f"rank {ranks[0]} replays"
    runs: list[list] = []
    for r in ranks:
        if runs and isinstance(r, int) and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    return "ranks " + ", ".join(f"{run[0]}-{run[-1]}" if len(run) > 1 else f"{run[0]}"
                                for run in runs) + " replay"
