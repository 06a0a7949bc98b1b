"""Storages the original holds past their last use in the trace (actors/trace/fsdp2_lifetimes.py,
actors/trace/autograd_lifetimes.py), on a real 2-rank gloo capture of a small Llama under FSDP2,
bf16 mixed precision and full activation checkpointing: each rule on its own, then the dry
run's accounted peak against the run's measured peak (the CPU allocation counter)."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

import actors.replay.program as program_module
from actors.trace.conventions import trace_file_name
from actors.replay.config import AllocationConfig, ReplayConfig
from actors.replay.engine import ReplayEngine
from actors.trace import load_trace
from actors.trace.autograd_lifetimes import (_gradient_ops, _recomputes, hold_checkpoint_inputs,
                                             hold_node_inputs, is_backward_node)
from actors.trace.fsdp2_lifetimes import (COPY_OUT_RANGE, GATHER_RANGE, REDUCE_RANGE,
                                          _ModuleIndex, _reshard_index,
                                          hold_forward_all_gather_outputs,
                                          hold_unsharded_parameters)
from actors.trace.liveness import compute_liveness
from tests.support.trace_factory import run_rank_script

# d_model 64, 3 blocks, seq 128: the peak is in a block's backward, as on the bench's model.
WORKLOAD = dict(model="llama", vocab=64, d_model=64, n_layers=3, n_heads=4, ffn_dim=256,
                seq_len=128, batch_size=2, parallel="fsdp2", precision="bf16_mixed",
                activation_checkpointing="full", device="cpu")
_RANK_SCRIPT = r'''
import json, os, sys
rank, world, port, out = sys.argv[1:5]
os.environ.update(RANK=rank, WORLD_SIZE=world, MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                  LOCAL_RANK=rank)
from actors.capture.request import CaptureRequest
from actors.capture.worker import run_capture
facts = run_capture(CaptureRequest.from_dict(json.loads(os.environ["HELD_CAPTURE_CFG"])), out)
with open(os.path.join(out, f"facts-{rank}.json"), "w") as f:
    json.dump({"peak_memory_bytes": facts["peak_memory_bytes"]}, f)
os._exit(0)  # torch sometimes aborts in static destructors after gloo + ET (trace_factory)
'''
RULES = ("hold_unsharded_parameters", "hold_forward_all_gather_outputs", "hold_checkpoint_inputs",
         "hold_node_inputs")


@pytest.fixture(scope="module")
def capture(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp2_full_ac")
    cfg = {"workload": WORKLOAD, "warmup_iters": 2, "timing_iters": 1, "record_kineto": False,
           "dist_timeout_s": 60, "num_threads": 1}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HELD_CAPTURE_CFG", json.dumps(cfg))
        mp.setenv("PYTHONPATH", str(Path(__file__).resolve().parents[1]))
        run_rank_script(_RANK_SCRIPT, out, 2, "FSDP2 full-AC capture", timeout_s=240)
    return out


@pytest.fixture(scope="module")
def trace(capture):
    return load_trace(capture / trace_file_name(0))


def test_reshard_index_before_the_reduce_or_at_the_forward_end():
    """The reshard of a gather: before the module's post-backward reduce when it comes first,
    else the last op inside the module (not a sibling sharing its name's start) before the
    next gather of the module."""
    sfx = " (layers.0)"
    modules = [GATHER_RANGE + sfx, COPY_OUT_RANGE + sfx, "## module:layers.0 ##",
               "## module:layers.0.attn ##", "## module:layers.01 ##", GATHER_RANGE + sfx,
               COPY_OUT_RANGE + sfx, "## module:layers.0 ##", REDUCE_RANGE + sfx,
               REDUCE_RANGE + sfx, "## module:layers.0 ##"]
    ops = [SimpleNamespace(index=i, module=m) for i, m in enumerate(modules)]
    index = _ModuleIndex(ops)
    assert _reshard_index(index, 1, sfx, "layers.0") == 3  # the regather at 5 comes first
    assert _reshard_index(index, 6, sfx, "layers.0") == 7  # the reduce range starts at 8
    assert _reshard_index(index, 9, sfx, "layers.0") == 10  # neither follows: the last inside


def test_unsharded_parameters_live_until_their_module_reshards(trace):
    """A backward all-gather's parameters are freed by FSDP2's post-backward reshard, just
    before the module's reduce-scatter, not at their last matmul."""
    live = compute_liveness(trace.ops, trace.num_storages)
    copies = [op for op in trace.ops if op.name == "fsdp::split_with_sizes_copy"]
    before = {t.suid: live.storage_last[t.suid] for op in copies for t in op.input_tensors()[1:]}
    assert hold_unsharded_parameters(trace.ops, live) > 0
    checked = 0
    for op in copies:
        suffix = op.module[op.module.index(" ("):] if " (" in op.module else ""
        reduce_at = next((o.index for o in trace.ops[op.index:]
                          if o.module == REDUCE_RANGE + suffix), None)
        regather = next((o.index for o in trace.ops[op.index + 1:]
                         if o.module == op.module), None)
        if reduce_at is None or (regather is not None and regather < reduce_at):
            continue  # a forward gather, resharded after the forward
        for t in op.input_tensors()[1:]:
            end = live.storage_last[t.suid]
            assert end >= before[t.suid]
            assert trace.ops[end + 1].module == REDUCE_RANGE + suffix != trace.ops[end].module
            checked += 1
    assert checked >= 3 * 9  # every block's 9 parameters, gathered again for its backward


def test_a_forward_all_gather_output_lives_until_the_next_copy_out(trace):
    """In forward FSDP2 keeps the flat all-gather output until the next module's copy-out (the
    last one until the root's post-forward); the trace's last use is its own copy-out."""
    live = compute_liveness(trace.ops, trace.num_storages)
    backward = next(op.index for op in trace.ops if is_backward_node(op.module))
    copies = [op for op in trace.ops if op.name == "fsdp::split_with_sizes_copy"
              and op.index < backward]
    assert len(copies) == 1 + WORKLOAD["n_layers"]  # the root, then every block
    flats = [op.input_tensors()[0].suid for op in copies]
    assert all(live.storage_last[s] == op.index for s, op in zip(flats, copies))
    assert hold_forward_all_gather_outputs(trace.ops, live) == len(copies)
    for flat, nxt in zip(flats, copies[1:]):
        end = live.storage_last[flat]
        assert trace.ops[end + 1].module.startswith(COPY_OUT_RANGE)
        assert trace.ops[end].module != trace.ops[end + 1].module == nxt.module
    assert copies[-1].index < live.storage_last[flats[-1]] < backward


def test_a_backward_node_holds_its_inputs_until_it_returns(trace):
    """MulBackward0 computes grad * b, then grad * a: its saved ``b`` is still held by the
    node while the second product is made."""
    live = compute_liveness(trace.ops, trace.num_storages)
    own = _gradient_ops(trace.ops)
    last = list(live.storage_last)
    assert hold_node_inputs(trace.ops, live) > 0
    ops = trace.ops
    seen = 0
    for i in range(1, len(ops) - 1):
        a, b = ops[i], ops[i + 1]
        if a.module == b.module == "MulBackward0" and own[i] and own[i + 1] \
                and ops[i - 1].module != "MulBackward0":
            saved = [t.suid for t in a.input_tensors() if last[t.suid] == i]
            for s in saved:  # the trace's last read of a saved input: the first product
                assert live.storage_last[s] == i + 1
            seen += bool(saved)
    assert seen >= WORKLOAD["n_layers"]  # at least the SwiGLU product of every block


def test_a_checkpointed_blocks_input_lives_through_its_backward(trace):
    """The recompute reads the block input last, but the checkpoint frame holds it until the
    block's backward has run: no longer freed inside the recompute."""
    live = compute_liveness(trace.ops, trace.num_storages)
    own = _gradient_ops(trace.ops)
    node_ops = [op.index for op in trace.ops if own[op.index]]
    spans = _recomputes(trace.ops, own, node_ops[0])
    assert len(spans) == WORKLOAD["n_layers"]  # every block recomputed once
    before = list(live.storage_last)
    assert hold_checkpoint_inputs(trace.ops, live) >= WORKLOAD["n_layers"]
    for first, last in spans:
        moved = [s for s in range(trace.num_storages)
                 if first <= before[s] <= last and live.storage_last[s] != before[s]]
        # the block input, 2 x 128 x 64 bf16: one per recompute. A real capture may also name
        # a few bytes of forward storage read in the recompute (a freed address the CPU
        # allocator handed out again: a fresh-clone run held 8 B so), held by the same rule
        inputs = [s for s in moved if live.storage_bytes[s] == 2 * 128 * 64 * 2]
        assert len(inputs) == 1, f"recompute at ops {first}-{last}: the block input is not held"
        for s in moved:
            end = live.storage_last[s]
            assert end > last and is_backward_node(trace.ops[end].module)
            assert live.storage_first[s] < node_ops[0]  # made before the backward began


def _accounted_peak(path: Path) -> int:
    trace = load_trace(path)
    engine = ReplayEngine(trace, ReplayConfig(
        mode="compute", device="meta", iters=1, warmup_iters=1, measure_memory=False,
        allocation=AllocationConfig(mode="faithful")))
    try:
        report = engine.run().to_dict()
    finally:
        engine.close()
    assert report["status"] == "ok", report["error"]
    return report["accounted_peak_bytes"]


def test_dry_run_peak_matches_the_measured_peak(capture, monkeypatch):
    """With the rules the faithful dry run's peak is the measured one (within 2%, or within 2%
    of it less one gloo reduce-scatter copy freed late; see below); without them it is ~6%
    short."""
    measured = max(json.loads((capture / f"facts-{r}.json").read_text())["peak_memory_bytes"]
                   for r in range(2))
    paths = [capture / trace_file_name(r) for r in range(2)]
    accounted = max(_accounted_peak(p) for p in paths)
    ratio = accounted / measured
    # gloo (CPU only) copies a reduce-scatter's input and frees the copy from its worker
    # thread at its own pace: when that lands on the peak, the measured peak holds one copy
    # more (seen here: +221 KB, in about one run of five), which NCCL never makes and the dry
    # run does not model (docs/prediction.md)
    trace = load_trace(paths[0])
    gloo_copy = max(t.numel * t.itemsize for op in trace.collectives
                    if op.collective.kind == "reduce_scatter_tensor" for t in op.input_tensors())
    assert 0.98 <= ratio <= 1.02 or 0.98 <= accounted / (measured - gloo_copy) <= 1.02, \
        (ratio, measured, gloo_copy)
    for name in RULES:
        monkeypatch.setattr(program_module, name, lambda ops, live: 0)
    without = max(_accounted_peak(p) for p in paths) / measured
    assert without < 0.96 and ratio - without > 0.04, (ratio, without)


def test_only_faithful_holds_storages_longer(trace):
    """lazy stays the trace's liveness bound: every storage freed at its last use."""
    plain = compute_liveness(trace.ops, trace.num_storages).storage_last
    held = {}
    for mode in ("lazy", "faithful"):
        engine = ReplayEngine(trace, ReplayConfig(
            mode="compute", device="meta", iters=1, warmup_iters=0, measure_memory=False,
            allocation=AllocationConfig(mode=mode)))
        held[mode] = engine.liveness.storage_last
        engine.close()
    assert held["lazy"] == plain
    assert sum(a > b for a, b in zip(held["faithful"], plain)) > 0
