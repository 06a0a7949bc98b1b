"""``tracefleet-capture ... workload.device=fake workload.check_fake=true``: does the fake
capture follow the real run? The same workload is captured for real on cpu (gloo, Ray ranks)
and on fake, both at world 2, and rank 0's traces are compared op by op
(actors/trace/fake_vs_real.py): the histograms and the first place they part. The user makes
the model small enough for this machine (examples/ read EXAMPLE_* environment variables).
Writes ``check_fake/{real,fake}/`` and ``check_fake.json`` beside the fake capture.
"""
from __future__ import annotations

import copy
import json
import os
from typing import Callable

from actors.capture.workloads.config import WorkloadDevice
from actors.trace.conventions import trace_file_name
from actors.trace.fake_vs_real import FakeCheck, compare_captures
from orchestrator.outputs import CHECK_FAKE_JSON

CHECK_WORLD_SIZE = 2
CHECK_DIR = "check_fake"


def check_fake(cfg, out_dir: str, run_capture_job: Callable[..., object]) -> FakeCheck:
    """Capture ``cfg``'s workload for real and on fake at world 2 under ``out_dir`` with
    ``run_capture_job`` (orchestrator/run/capture.py's, which calls this: passed, not imported)
    and compare rank 0's traces; the outcome is also written to ``out_dir/check_fake.json``."""
    paths = {}
    for device, rank0_only in ((WorkloadDevice.cpu, False), (WorkloadDevice.fake, True)):
        side = copy.deepcopy(cfg)
        side.workload.device, side.workload.check_fake = device, False
        side.world_size, side.overwrite, side.record_kineto = CHECK_WORLD_SIZE, True, False
        side.warmup_iters, side.timing_iters = max(2, min(cfg.warmup_iters, 3)), 1
        side.out_dir = os.path.join(out_dir, CHECK_DIR, str(device))
        run_capture_job(side, rank0_only=rank0_only)
        paths[str(device)] = os.path.join(side.out_dir, trace_file_name(0))
    check = compare_captures(paths["cpu"], paths["fake"])
    with open(os.path.join(out_dir, CHECK_FAKE_JSON), "w") as f:
        json.dump({"world_size": CHECK_WORLD_SIZE, "real_trace": paths["cpu"],
                   "fake_trace": paths["fake"], **check.to_dict()}, f, indent=2)
    return check


def check_lines(check: FakeCheck) -> list[str]:
    """What ``tracefleet-capture`` prints about the check."""
    head = (f"check_fake: {check.num_compared_real} real and {check.num_compared_fake} fake ops "
            f"compared at world {CHECK_WORLD_SIZE} ({check.num_backend_ops} of the real run's "
            f"backend ops left out, {check.num_accumulations} gradient accumulations read as "
            "one)")
    if check.equal:
        return [head, "check_fake: the fake capture follows the real run (same ops, same "
                      "output sizes, in the same order)"]
    lines = [head]
    for name, (real, fake) in list(check.histogram_diff.items())[:8]:
        lines.append(f"check_fake: {name}: real {real}, fake {fake}")
    d = check.first_divergence
    if d is not None:
        lines.append(f"check_fake: first divergence at op {d['index']}: real {d['real']}; "
                     f"fake {d['fake']}")
    return lines
