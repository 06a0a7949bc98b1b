"""Capture one ``build(ctx)`` on the fake device and for real on CPU, and compare the two
traces' top-level op histograms (names and counts, ``actors.trace.load_trace``'s ops).

Both captures take the production path of ``workload=custom``: the fake one is
:func:`actors.capture.fake_rank.record_meta_rank` (fake process group, ``CaptureFakeMode``,
one warm-up, the recorder), the real one the same builder, warm-up and recorder on cpu in this
process over a 1-rank gloo group (the steps compared here have no collectives of their own; a
world-2 real capture needs Ray: tests/capture/test_capture_custom.py). One intra-op thread on
the real side: a parallel kernel's scratch ops on pool threads would be top-level ops of their
own.

``as_entrypoint(build, name)`` makes a closure (a step with parameters) loadable by name, as
``workload.entrypoint`` loads a user's function, so tests can parametrize steps.

The one difference the fake device makes by design is folded before comparing: the autograd
engine accumulates a gradient several uses produce in place on cpu (``aten::add_``) and out of
place on fake (``aten::add``: FakeTensors are subclass-like, which torch accumulates out of
place); :func:`engine_accumulations` counts them from the trace's autograd frames.
"""
from __future__ import annotations

import gzip
import re
import sys
from collections import Counter
from pathlib import Path
from typing import Callable

import orjson
import torch
import torch.distributed as dist

from actors.capture.workloads.context import world_mesh
from actors.capture.fake_rank import record_meta_rank
from actors.capture.recorder import record_iteration
from actors.capture.request import CaptureRequest
from actors.capture.worker import warm_up
from actors.capture.workloads.build import WorkloadConfig, build_workload
from actors.trace import Trace, load_trace
from actors.trace.conventions import trace_file_name

ENGINE_FRAME = "autograd::engine::evaluate_function: "
REAL_WARMUP_ITERS = 3


def as_entrypoint(build: Callable, name: str) -> str:
    """``build`` bound in this module under ``name`` (made an identifier; a later binding of the
    same name replaces it); its ``workload.entrypoint`` spec."""
    attr = "build_" + re.sub(r"\W", "_", name)
    setattr(sys.modules[__name__], attr, build)
    return f"{__name__}:{attr}"


def _capture_request(spec: str, device: str) -> CaptureRequest:
    return CaptureRequest(WorkloadConfig(model="custom", entrypoint=spec, device=device),
                          module_backward_ranges=True)


def capture_fake(spec: str, out_dir: Path, world_size: int = 1) -> Path:
    """Rank 0's trace of ``spec`` captured on ``workload.device=fake`` at ``world_size``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    _, path = record_meta_rank(_capture_request(spec, "fake"), str(out_dir), 0, world_size)
    return Path(path)


def capture_real(spec: str, out_dir: Path) -> Path:
    """The trace of ``spec`` captured on cpu, one rank, in this process (see module doc)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / trace_file_name(0)
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        cfg = WorkloadConfig(model="custom", entrypoint=spec, device="cpu")
        workload = build_workload(cfg, 0, 1, torch.device("cpu"), world_mesh("cpu", 1))
        # as many as the fake capture's settle() may run (DDP rebuilds its buckets after the
        # first iteration): every step records its steady state on both sides
        warm_up(workload, REAL_WARMUP_ITERS)
        record_iteration(workload.step, workload.next_batch(), workload.model,
                         step_index=REAL_WARMUP_ITERS, out_path=str(path), tensor_ranges=False)
    finally:
        dist.destroy_process_group()
        torch.set_num_threads(num_threads)
    return path


def _nodes(path: Path) -> list[dict]:
    with gzip.open(path) as f:
        return orjson.loads(f.read())["nodes"]


def engine_accumulations(path: Path, name: str) -> int:
    """Ops ``name`` the autograd engine itself ran (directly under an ``evaluate_function``
    frame, not inside the backward function): its accumulation of a gradient's parts."""
    nodes = _nodes(path)
    names = {n["id"]: n["name"] for n in nodes}
    return sum(n["name"] == name and names.get(n["ctrl_deps"], "").startswith(ENGINE_FRAME)
               for n in nodes)


def op_histogram(trace: Trace) -> Counter:
    """Names and counts of the trace's top-level ops (within its ProfilerStep window)."""
    return Counter(op.name for op in trace.ops)


def histogram_diff(real: Counter, fake: Counter) -> str:
    """One line per op name whose count differs (``name: real N, fake M``); "" when equal."""
    return "; ".join(f"{name}: real {real[name]}, fake {fake[name]}"
                     for name in sorted(set(real) | set(fake)) if real[name] != fake[name])


def folded_histograms(real_path: Path, fake_path: Path) -> tuple[Counter, Counter]:
    """The two traces' op histograms, the engine's in-place accumulations of the real one
    counted as the out-of-place ones fake records (see the module docstring)."""
    real = op_histogram(load_trace(real_path))
    fake = op_histogram(load_trace(fake_path))
    in_place = engine_accumulations(real_path, "aten::add_")
    real["aten::add_"] -= in_place
    real["aten::add"] += in_place
    assert engine_accumulations(fake_path, "aten::add_") == 0
    return +real, +fake


def compare_fake_to_real(spec: str, out_dir: Path, world_size: int = 1) -> tuple[Trace, Trace]:
    """Capture ``spec`` both ways under ``out_dir`` and assert the same op histogram (the
    engine's in-place accumulations folded, see the module docstring); ``(real, fake)``."""
    diff, real_path, fake_path = _captured_diff(spec, out_dir, world_size)
    assert not diff, f"{spec}: fake and real op histograms differ: {diff}"
    return load_trace(real_path), load_trace(fake_path)


def known_difference(spec: str, out_dir: Path) -> str:
    """Capture ``spec`` both ways under ``out_dir``; the histograms' difference (folded), for a
    step whose fake run is known to differ (``histogram_diff``'s form)."""
    return _captured_diff(spec, out_dir, 1)[0]


def _captured_diff(spec: str, out_dir: Path, world_size: int) -> tuple[str, Path, Path]:
    """Both captures of ``spec`` under ``out_dir`` and their folded histograms' difference."""
    fake_path = capture_fake(spec, out_dir / "fake", world_size)
    real_path = capture_real(spec, out_dir / "real")
    return histogram_diff(*folded_histograms(real_path, fake_path)), real_path, fake_path
