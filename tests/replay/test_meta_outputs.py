"""Meta dry runs with recorded outputs (actors/replay/ops/meta_outputs.py) account exactly as the
meta kernels do: same peak, breakdown, peak op, flushes, materializations, coverage and
timeline, on the demo traces and on a meta-captured llama under ZeRO-3 emulation; views and
metadata-changing ops keep their kernels; a recipe refuses an input a flush dropped."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from actors.replay.config import AllocationConfig, ReplayConfig
from actors.replay.engine import ReplayEngine
from actors.replay.ops.meta_outputs import RecordedOutputs
from actors.replay.step_plan import Step
from actors.trace import load_trace
from actors.zero3.config import Zero3Config
from actors.zero3.extension import zero3_extensions
from orchestrator.config import DEMO_TRACES
from tests.capture.test_capture_meta import meta_capture

DEMO = DEMO_TRACES
# everything a dry run decides from memory accounting, and what it could replay
SAME = ("status", "error", "accounted_peak_bytes", "peak_breakdown", "peak_op", "num_flushes",
        "flushed_bytes", "flush_ticks", "num_materialized", "coverage", "num_replayed",
        "skipped_reasons", "standin_ops", "num_shape_mismatches", "memory_timeline",
        "num_iterations_completed")


def dry_run(trace, recorded: bool, zero3: Zero3Config | None = None, capacity=None,
            threshold: float = 1.0):
    cfg = ReplayConfig(mode="compute", device="meta", iters=2, warmup_iters=1,
                       measure_memory=False, meta_recorded_outputs=recorded,
                       device_memory_capacity=capacity,
                       allocation=AllocationConfig(mode="faithful",
                                                   device_memory_threshold=threshold))
    engine = ReplayEngine(trace, cfg, extensions=zero3_extensions(zero3, trace) if zero3 else ())
    report = engine.run().to_dict()
    assert report["status"] == "ok", report["error"]
    return engine, report


def assert_same_accounting(trace, zero3=None):
    """Kernels vs recorded outputs, without and then with flushes (threshold at 60% of a
    capacity equal to the unflushed peak)."""
    engine, fast = dry_run(trace, True, zero3)
    _, slow = dry_run(trace, False, zero3)
    assert {k: fast[k] for k in SAME} == {k: slow[k] for k in SAME}
    # the fast path really ran: most compute ops were rebuilt, not computed
    compute = sum(s.kind == "compute" for s in engine.steps)
    assert engine.recorded.num_recorded > compute // 2
    capacity = slow["accounted_peak_bytes"]
    _, fast = dry_run(trace, True, zero3, capacity, 0.6)
    _, slow = dry_run(trace, False, zero3, capacity, 0.6)
    assert slow["num_flushes"] > 0 and slow["num_materialized"] > 0
    assert {k: fast[k] for k in SAME} == {k: slow[k] for k in SAME}


@pytest.mark.parametrize("name", sorted(p.name for p in DEMO.iterdir()))
def test_demo_traces_account_the_same(name):
    assert_same_accounting(load_trace(DEMO / name / "rank-0.et.json.gz"))


def test_meta_llama_under_zero3_accounts_the_same(tmp_path):
    meta_capture(tmp_path, 2, dtype="bfloat16")
    trace = load_trace(tmp_path / "rank-0.et.json.gz")
    assert_same_accounting(trace, Zero3Config(strategy="per_module", world_size=64,
                                              param_persistence_threshold=0))


def _step(name, kernel, positions=(0,)):
    return Step(SimpleNamespace(name=name), "compute", fn=kernel,
                tensor_slots=tuple((p, None) for p in positions))


def _probe_once(steps, args):
    """Probe each step once on ``args`` (one tuple per step), then install the recipes."""
    recorded = RecordedOutputs(steps)
    recorded.probe()
    outs = [s.fn(*a) for s, a in zip(steps, args)]
    recorded.install()
    return recorded, outs


def test_fresh_and_in_place_outputs_are_rebuilt_views_and_metadata_changes_keep_kernels():
    x = torch.empty(4, 6, device="meta")
    add, add_, view = torch.ops.aten.add.Tensor, torch.ops.aten.add_.Tensor, torch.ops.aten.t
    transpose_ = torch.ops.aten.transpose_.default
    steps = [_step("aten::add", add, (0, 1)), _step("aten::add_", add_, (0, 1)),
             _step("aten::t", view), _step("aten::transpose_", lambda a: transpose_(a, 0, 1))]
    recorded, outs = _probe_once(steps, [(x, x), (x, x), (x,), (x.clone(),)])
    assert recorded.num_recorded == 2
    assert [s.fn is k for s, k in zip(steps, (add, add_, view))] == [False, False, True]
    assert steps[3].fn.__name__ == "<lambda>"  # transpose_ changed x's strides: kernel kept
    y = torch.empty(4, 6, device="meta")
    made = steps[0].fn(y, y)
    assert made.shape == outs[0].shape and made.stride() == outs[0].stride() \
        and made.dtype == outs[0].dtype and made.untyped_storage()._cdata != \
        y.untyped_storage()._cdata
    assert steps[1].fn(y, y) is y  # in place: the input itself, as the kernel returns it
    with pytest.raises(TypeError, match="dropped by a flush"):
        steps[0].fn(None, y)  # like the kernel: the loop then re-materializes and retries


def test_multi_output_and_offset_outputs():
    x = torch.empty(3, 8, device="meta")
    lnorm = torch.ops.aten.native_layer_norm.default
    steps = [_step("aten::native_layer_norm", lambda a: lnorm(a, [8], None, None, 1e-5)),
             _step("aten::sort", torch.ops.aten.sort.default),
             _step("offset", lambda a: torch.empty(30, device="meta")[2:]),
             _step("sparse", lambda a: torch.eye(2).to_sparse())]
    recorded, outs = _probe_once(steps, [(x,)] * 4)
    # an output at an offset of its storage, or without a storage, keeps the kernel (and a
    # probe that cannot inspect an output never fails the op)
    assert recorded.num_recorded == 2 and outs[3].layout is torch.sparse_coo
    assert steps[3].fn(x).layout is torch.sparse_coo
    again = steps[0].fn(x)
    assert type(again) is tuple and [t.shape for t in again] == [t.shape for t in outs[0]]
    assert [t.dtype for t in steps[1].fn(x)] == [torch.float32, torch.int64]


def test_a_repeated_signature_reuses_the_recipe_without_the_kernel():
    calls = []
    add = torch.ops.aten.add.Tensor

    def kernel(a, b, alpha=1):
        calls.append((a.shape, type(alpha)))
        return add(a, b, alpha=alpha)
    x, y = torch.empty(4, 6, device="meta"), torch.empty(4, 6, device="meta")
    z = torch.empty(2, 3, device="meta", dtype=torch.bfloat16)
    steps = [_step(f"add{i}", kernel, (0, 1)) for i in range(5)]
    recorded = RecordedOutputs(steps)
    recorded.probe()
    outs = [steps[0].fn(x, y), steps[1].fn(y, x), steps[2].fn(z, z), steps[3].fn(x, y, alpha=2),
            steps[4].fn(x, y, alpha=2.0)]
    # same callable, metadata and values: rebuilt (step 1); another shape or dtype, a keyword of
    # another value or type (2 vs 2.0 are equal in Python): the kernel ran
    assert recorded.num_reused == 1 and len(calls) == 4
    assert outs[1].shape == outs[0].shape and outs[1].dtype == outs[0].dtype \
        and outs[1].untyped_storage()._cdata != outs[0].untyped_storage()._cdata
    assert [o.dtype for o in outs[2:]] == [torch.bfloat16, torch.float32, torch.float32]
    recorded.install()
    assert recorded.num_recorded == 5  # a reused recipe is installed like a probed one
    assert steps[1].fn(x, y).shape == (4, 6)


def test_signature_tells_shared_storages_and_unkeyable_arguments_apart():
    calls = []

    def kernel(a, b, extra=None):
        calls.append(1)
        return torch.ops.aten.add.Tensor(a, b)
    x, y = torch.empty(3, device="meta"), torch.empty(3, device="meta")
    steps = [_step(f"k{i}", kernel, (0, 1)) for i in range(4)]
    recorded = RecordedOutputs(steps)
    recorded.probe()
    steps[0].fn(x, y)
    steps[1].fn(x, x)  # one storage for both inputs: another signature
    steps[2].fn(x, y, extra=object())  # an argument a signature cannot key by value
    steps[3].fn(x, y, extra=object())
    assert len(calls) == 4 and recorded.num_reused == 0
