"""Device translation: every table entry gives the recorded outputs on cpu and meta; where a
translation applies; ops with no equivalent stay skipped with their reason; public traces."""
from __future__ import annotations

import copy

import pytest
import torch

from actors.replay import step_plan
from actors.replay.ops import translate
from actors.replay.config import AllocationConfig, ReplayConfig
from actors.replay.engine import ReplayEngine
from actors.trace import load_trace
from actors.trace.model import Arg, TensorArg
from actors.trace.op_schema import parse_schema
from tests.support import et_json
from tests.support import foreign_ops as F

CPU, META, CUDA = torch.device("cpu"), torch.device("meta"), torch.device("cuda")


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> dict:
    """Recorded op name -> its ops, over the three traces of tests/support/foreign_ops.py."""
    tmp = tmp_path_factory.mktemp("foreign")
    traces = (F.gpu_kernels_on_meta(tmp / "meta.json"), F.fused_optimizers_on_cpu(tmp / "cpu.json"),
              F.without_kernels(tmp))
    ops: dict = {}
    for trace in traces:
        for op in trace.ops:
            ops.setdefault(op.name, []).append(op)
    return ops


def _compiled(op, device):
    step = step_plan.compile_step(op, device, "compute")
    assert step.kind == "compute", step.reason
    return step


def test_every_table_entry_has_a_recorded_case(recorded):
    assert set(translate.TRANSLATIONS) - set(recorded) == set()


@pytest.mark.parametrize("device", [CPU, META], ids=str)
@pytest.mark.parametrize("name", sorted(translate.TRANSLATIONS))
def test_translation_returns_the_recorded_outputs(recorded, name, device, monkeypatch):
    """Shapes, dtypes, scalars and undefined outputs as the GPU kernel recorded them (its meta
    kernel, or the convolution formula), through the plan's own argument binding."""
    monkeypatch.setattr(translate, "runs_natively", lambda *a: False)  # translate everywhere
    for op in recorded[name]:
        step = _compiled(op, device)
        assert step.translated_from == name
        assert F.as_recorded(op, F.run_step(step, device)) == F.recorded_outputs(op)


def _one(recorded, name, overload=""):
    return next(op for op in recorded[name] if op.schema.startswith(f"{name}{overload}("))


@pytest.mark.parametrize("name, overload, translated_on", [
    ("aten::cudnn_batch_norm_backward", "", {"cpu"}),  # a meta kernel, no CPU kernel
    ("aten::_scaled_dot_product_flash_attention", "", {"cpu"}),
    ("aten::cudnn_convolution", "", {"cpu", "meta"}),  # no kernel but CUDA's
    ("aten::_fused_sgd_", "", {"meta"}),  # CPU kernel, no meta kernel
    ("aten::_fused_adam_", "", set()),  # both
    ("aten::_fused_adam_", ".tensor_lr", {"meta"}),
    ("aten::pin_memory", "", {"cpu", "meta"}),  # dispatches, then needs a GPU
    ("aten::record_stream", "", {"cpu", "meta"}),
    ("fbgemm::asynchronous_complete_cumsum", "", {"cpu", "meta"}),  # not loaded here
])
def test_translates_only_where_the_recorded_op_cannot_run(recorded, name, overload, translated_on):
    op = _one(recorded, name, overload)
    assert {d.type for d in (CPU, META) if translate.lookup(op, d) is not None} == translated_on


@pytest.mark.parametrize("name", ["aten::pin_memory", "aten::_pin_memory", "aten::record_stream"])
def test_host_memory_and_stream_ops_run_as_recorded_on_cuda(recorded, name):
    assert translate.TRANSLATIONS[name].off_cuda
    assert translate.lookup(_one(recorded, name), CUDA) is None


def test_runs_natively_checks_the_overload():
    adam = torch.ops.aten._fused_adam_
    assert translate.runs_natively("aten::_fused_adam_", str(adam.default._schema), "meta")
    assert not translate.runs_natively("aten::_fused_adam_", str(adam.tensor_lr._schema), "meta")
    assert not translate.runs_natively("fbgemm::bounds_check_indices", "", "cpu")


def _with_input(op, name, value):
    """A copy of ``op`` with the recorded argument ``name`` replaced."""
    names = [a.name for a in parse_schema(op.schema).args]
    inputs = list(op.inputs) + [Arg("none", None)] * (len(names) - len(op.inputs))
    inputs[names.index(name)] = value
    changed = copy.copy(op)
    changed.inputs = tuple(inputs)
    return changed


def test_packed_variable_length_attention_stays_skipped_with_its_reason(recorded):
    op = _one(recorded, "aten::_flash_attention_forward")
    cum_seq = TensorArg(900, 900, 0, 3, 4, "cuda:0", (3,), (1,), "int32")
    step = step_plan.compile_step(_with_input(op, "cum_seq_q", cum_seq), CPU, "compute")
    assert step.kind == "skip"
    assert step.reason == ("aten::_flash_attention_forward: packed variable-length input "
                           "(cum_seq_q) (no equivalent on cpu)")


def test_an_option_the_equivalent_lacks_stays_skipped(recorded):
    op = _one(recorded, "aten::_flash_attention_backward")
    step = step_plan.compile_step(_with_input(op, "window_size_left", Arg("int", 128)), CPU,
                                  "compute")
    assert step.kind == "skip"
    assert "argument 'window_size_left' is not supported" in step.reason


def test_flash_causal_with_unequal_lengths_stays_skipped(recorded):
    """The flash kernel aligns a causal mask to the bottom right when L != S; the CPU kernel
    to the top left: no equivalent."""
    op = _one(recorded, "aten::_scaled_dot_product_flash_attention")  # L=16, S=24
    step = step_plan.compile_step(_with_input(op, "is_causal", Arg("bool", True)), CPU, "compute")
    assert step.kind == "skip" and "bottom right with L != S" in step.reason


def test_attention_bias_gradient_stays_skipped(recorded):
    op = _one(recorded, "aten::_efficient_attention_backward")
    step = step_plan.compile_step(_with_input(op, "bias_requires_grad", Arg("bool", True)), CPU,
                             "compute")
    assert step.kind == "skip" and "the gradient of the attention bias" in step.reason


def test_public_resnet_batch_norm_backward_gives_recorded_outputs(public_trace_dir, monkeypatch):
    """The 159 ``cudnn_batch_norm_backward`` of the public ResNet: the two smallest shapes run
    on cpu, all twelve shapes on meta (where the translation is forced)."""
    trace = load_trace(public_trace_dir / "resnet_et.json.gz")
    by_shape = {}
    for op in trace.ops:
        if op.name == "aten::cudnn_batch_norm_backward":
            by_shape.setdefault(op.inputs[0].shape, op)
    assert len(by_shape) == 12
    smallest = sorted(by_shape.values(), key=lambda op: op.inputs[0].numel)[:2]
    for op in smallest:
        assert F.as_recorded(op, F.run_step(_compiled(op, CPU), CPU)) == F.recorded_outputs(op)
    monkeypatch.setattr(translate, "runs_natively", lambda *a: False)
    for op in by_shape.values():
        assert F.as_recorded(op, F.run_step(_compiled(op, META), META)) == F.recorded_outputs(op)


def test_public_dlrm_fbgemm_ops_give_recorded_outputs(dlrm_rank_dir):
    trace = load_trace(dlrm_rank_dir / "rank-0.json")
    names = {"fbgemm::asynchronous_complete_cumsum", "fbgemm::bounds_check_indices"}
    ops = [op for op in trace.ops if op.name in names]
    assert len(ops) == 3
    for op in ops:
        step = _compiled(op, CPU)
        assert step.translated_from == op.name
        assert F.as_recorded(op, F.run_step(step, CPU)) == F.recorded_outputs(op)


def _cfg(device):
    return ReplayConfig(mode="compute", device=device, iters=1, warmup_iters=0, strict=True,
                        allocation=AllocationConfig(mode="lazy"))


def test_engine_replays_a_cuda_conv_batch_norm_block_on_cpu(tmp_path):
    """conv -> batch norm -> its backward as a CUDA trace records them; strict, so any output
    shape or dtype off the trace fails the replay."""
    t, i = et_json.tensor, lambda v: et_json.scalar(v, "GenericList[Int,Int]")
    x, w = t(1, 1, 2 * 3 * 8 * 8, shape=[2, 3, 8, 8]), t(2, 2, 4 * 3 * 3 * 3, shape=[4, 3, 3, 3])
    y, stat = (lambda tid: t(tid, tid, 2 * 4 * 8 * 8, shape=[2, 4, 8, 8])), \
        (lambda tid: t(tid, tid, 4, shape=[4]))
    reserve = t(20, 20, 0, dtype="unsigned char", shape=[0], itemsize=1)
    flag, f = et_json.scalar(False, "Bool"), (lambda v: et_json.scalar(v, "Double"))
    conv = et_json.node(10, "aten::cudnn_convolution", schema=str(
        torch.ops.aten.cudnn_convolution.default._schema),
        inputs=[x, w, i([1, 1]), i([1, 1]), i([1, 1]), et_json.scalar(1), flag, flag, flag],
        outputs=[y(3)])
    bn = et_json.node(11, "aten::cudnn_batch_norm", schema=str(
        torch.ops.aten.cudnn_batch_norm.default._schema),
        inputs=[y(3), stat(4), stat(5), stat(6), stat(7), et_json.scalar(True, "Bool"), f(0.1),
                f(1e-5)], outputs=[y(8), stat(9), stat(12), reserve])
    bwd = et_json.node(12, "aten::cudnn_batch_norm_backward", schema=str(
        torch.ops.aten.cudnn_batch_norm_backward.default._schema),
        inputs=[y(3), y(8), stat(4), stat(6), stat(7), stat(9), stat(12), f(1e-5), reserve],
        outputs=[y(13), stat(14), stat(15)])
    path = et_json.write_trace(tmp_path, [F.contiguous_strides(n) for n in (conv, bn, bwd)])
    report = ReplayEngine(load_trace(path), _cfg("cpu")).run().to_dict()
    assert report["status"] == "ok", report["error"]
    assert report["coverage"] == 1.0 and report["num_shape_mismatches"] == 0
    assert report["translated_ops"] == {"aten::cudnn_convolution": 1, "aten::cudnn_batch_norm": 1,
                                        "aten::cudnn_batch_norm_backward": 1}


def test_engine_replays_a_fused_sgd_step_on_meta(tmp_path):
    """A real ``torch.optim.SGD(fused=True)`` step captured on cpu: meta has no fused SGD
    kernel, so it runs as its foreach form."""
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=True)

    def step():
        model(torch.randn(5, 4)).sum().backward()
        opt.step()
    step()
    trace = load_trace(F.record(tmp_path / "sgd.json", step))
    report = ReplayEngine(trace, _cfg("meta")).run().to_dict()
    assert report["status"] == "ok", report["error"]
    assert report["coverage"] == 1.0
    assert report["translated_ops"] == {"aten::_fused_sgd_": 1}
