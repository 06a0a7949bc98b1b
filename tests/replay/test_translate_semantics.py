"""Translations compute what the recorded kernels compute, checked on cpu against torch's own
references: functional convolutions and batch norm, SDPA's math path with autograd, the CPU
fused optimizer kernels."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as Fn

from actors.replay import step_plan
from actors.replay.ops import translate
from actors.trace.op_schema import parse_schema
from tests.support import foreign_ops as F

CPU = torch.device("cpu")
A = torch.ops.aten


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("semantics")
    ops: dict = {}
    for trace in (F.gpu_kernels_on_meta(tmp / "meta.json"), F.without_kernels(tmp),
                  F.fused_optimizers_on_cpu(tmp / "cpu.json")):
        for op in trace.ops:
            ops.setdefault(op.name, op)  # the first op of each name
    return ops


def _fn(recorded, name):
    """The translated callable for the recorded ``name`` (translation forced on cpu)."""
    op = recorded[name]
    fn = translate.TRANSLATIONS[name].build(op, parse_schema(op.schema), CPU)
    assert callable(fn), fn
    return fn


# The convolutions in foreign_ops.without_kernels: stride (2, 1), padding (1, 2),
# dilation (1, 2), groups 2, output_padding (1, 0), alpha 0.5.
_GEOM = dict(stride=(2, 1), padding=(1, 2), dilation=(1, 2), groups=2)


def _conv(x, w, b):
    return Fn.conv2d(x, w, b, **_GEOM)


def _conv_t(x, w, b):
    return Fn.conv_transpose2d(x, w, b, output_padding=(1, 0), **_GEOM)


@pytest.mark.parametrize("name, reference", [
    ("aten::cudnn_convolution", lambda a: _conv(a[0], a[1], None)),
    ("aten::cudnn_convolution_transpose", lambda a: _conv_t(a[0], a[1], None)),
    ("aten::cudnn_convolution_relu", lambda a: _conv(a[0], a[1], a[2]).relu()),
    ("aten::cudnn_convolution_add_relu", lambda a: (_conv(a[0], a[1], a[4]) + 0.5 * a[2]).relu()),
    ("aten::miopen_convolution", lambda a: _conv(a[0], a[1], a[2])),
    ("aten::miopen_depthwise_convolution", lambda a: _conv(a[0], a[1], a[2])),
    ("aten::miopen_convolution_transpose", lambda a: _conv_t(a[0], a[1], a[2])),
    ("aten::miopen_convolution_relu", lambda a: _conv(a[0], a[1], a[2]).relu()),
    ("aten::miopen_convolution_add_relu", lambda a: (_conv(a[0], a[1], a[4]) + 0.5 * a[2]).relu()),
])
def test_convolutions(recorded, name, reference):
    step = step_plan.compile_step(recorded[name], CPU, "compute")
    args, kwargs = F.fill(step, CPU)
    torch.testing.assert_close(step.fn(*args, **kwargs), reference(args))


@pytest.mark.parametrize("name", ["aten::cudnn_batch_norm", "aten::miopen_batch_norm"])
@pytest.mark.parametrize("training", [True, False])
def test_batch_norm_and_its_backward(recorded, name, training):
    x = torch.randn(2, 3, 5, 5, requires_grad=True)
    w, b = torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)
    mean, var = torch.randn(3), torch.rand(3) + 0.5
    ref_mean, ref_var = mean.clone(), var.clone()
    out = _fn(recorded, name)(x, w, b, mean, var, training, 0.1, 1e-5)
    ref = Fn.batch_norm(x, ref_mean, ref_var, w, b, training, 0.1, 1e-5)
    torch.testing.assert_close(out[0], ref)
    torch.testing.assert_close((mean, var), (ref_mean, ref_var))  # running stats updated alike
    if not training:
        return
    grad = torch.randn_like(ref)
    expected = torch.autograd.grad(ref, (x, w, b), grad)
    got = _fn(recorded, f"{name}_backward")(x, grad, w, mean, var, out[1], out[2], 1e-5,
                                            *([torch.empty(0, dtype=torch.uint8)] if "cudnn" in name else []))
    torch.testing.assert_close(got, expected)


def _rand(*shape):
    return torch.randn(*shape, requires_grad=True)


def _reference(q, k, v, causal=False, bias=None):
    """SDPA's math path in (B, H, L, E): output and, via autograd, a backward function."""
    mask = bias
    if causal:
        tri = torch.full((q.shape[2], k.shape[2]), float("-inf")).triu(1)
        mask = tri if bias is None else bias + tri
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        out = Fn.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return out, lambda grad: torch.autograd.grad(out, (q, k, v), grad)


def test_sdpa_flash_forward_and_backward(recorded):
    q, k, v = _rand(2, 4, 16, 8), _rand(2, 4, 16, 8), _rand(2, 4, 16, 8)
    ref, ref_grads = _reference(q, k, v, causal=True)
    res = _fn(recorded, "aten::_scaled_dot_product_flash_attention")(q, k, v, 0.0, True)
    torch.testing.assert_close(res[0], ref)
    grad = torch.randn_like(ref)
    got = _fn(recorded, "aten::_scaled_dot_product_flash_attention_backward")(
        grad, q, k, v, res[0], res[1], None, None, 16, 16, 0.0, True, res[6], res[7])
    torch.testing.assert_close(got, ref_grads(grad))


def test_sdpa_efficient_with_bias_and_a_narrower_value_head(recorded):
    q, k, v, bias = _rand(2, 4, 16, 8), _rand(2, 4, 24, 8), _rand(2, 4, 24, 6), torch.randn(2, 4, 16, 24)
    ref, ref_grads = _reference(q, k, v, bias=bias)
    res = _fn(recorded, "aten::_scaled_dot_product_efficient_attention")(q, k, v, bias, True)
    torch.testing.assert_close(res[0], ref)
    assert res[1].shape == (2, 4, 32)  # logsumexp padded to 32 rows like the GPU kernel's
    grad = torch.randn_like(ref)
    got = _fn(recorded, "aten::_scaled_dot_product_efficient_attention_backward")(
        grad, q, k, v, bias, res[0], res[1], res[2], res[3], 0.0, [True, True, True, False])
    torch.testing.assert_close(got[:3], ref_grads(grad))
    assert got[3] is None  # no bias gradient recorded


def test_sdpa_cudnn_forward_and_backward(recorded):
    q, k, v = _rand(2, 4, 16, 8), _rand(2, 4, 24, 8), _rand(2, 4, 24, 6)
    ref, ref_grads = _reference(q, k, v, causal=True)
    res = _fn(recorded, "aten::_scaled_dot_product_cudnn_attention")(q, k, v, None, True, 0.0, True)
    torch.testing.assert_close(res[0], ref)
    grad = torch.randn_like(ref)
    got = _fn(recorded, "aten::_scaled_dot_product_cudnn_attention_backward")(
        grad, q, k, v, res[0], res[1], res[6], res[7], None, None, None, 16, 24, 0.0, True)
    torch.testing.assert_close(got, ref_grads(grad))


def _blhe(*tensors):
    return [t.transpose(1, 2) for t in tensors]


def test_flash_kernel_in_its_own_layout(recorded):
    q, k, v = _rand(2, 4, 16, 8), _rand(2, 4, 24, 8), _rand(2, 4, 24, 8)
    ref, ref_grads = _reference(q, k, v)
    ql, kl, vl = _blhe(q, k, v)
    res = _fn(recorded, "aten::_flash_attention_forward")(ql, kl, vl, None, None, 16, 24, 0.0, False,
                                                          False)
    torch.testing.assert_close(res[0], ref.transpose(1, 2))
    grad = torch.randn_like(ref)
    got = _fn(recorded, "aten::_flash_attention_backward")(
        grad.transpose(1, 2), ql, kl, vl, res[0], res[1], None, None, 16, 24, 0.0, False, res[2],
        res[3])
    torch.testing.assert_close(got, tuple(_blhe(*ref_grads(grad))))


def test_efficient_kernel_in_its_own_layout_causal_with_bias(recorded):
    q, k, v, bias = _rand(2, 4, 16, 8), _rand(2, 4, 16, 8), _rand(2, 4, 16, 6), torch.randn(2, 4, 16, 16)
    ref, ref_grads = _reference(q, k, v, causal=True, bias=bias)
    ql, kl, vl = _blhe(q, k, v)
    res = _fn(recorded, "aten::_efficient_attention_forward")(ql, kl, vl, bias, None, None, None,
                                                              None, 0.0, 1, True)
    torch.testing.assert_close(res[0], ref.transpose(1, 2))
    grad = torch.randn_like(ref)
    got = _fn(recorded, "aten::_efficient_attention_backward")(
        grad.transpose(1, 2), ql, kl, vl, bias, res[0], None, None, 16, 16, res[1], 0.0, res[2],
        res[3], 1, False)
    torch.testing.assert_close(got[:3], tuple(_blhe(*ref_grads(grad))))


def _lists(n: int):
    """``n`` tensor lists of two parameters each."""
    torch.manual_seed(0)
    return [[torch.randn(5) for _ in range(2)] for _ in range(n)]


def _run_both(native, translated, lists, scalars, kwargs):
    """Run the CPU fused kernel and the translation on copies; return both states."""
    copies = [[[t.clone() for t in lst] for lst in lists] for _ in range(2)]
    native(*copies[0], *scalars, **kwargs)
    translated(*copies[1], *scalars, **{k: (v.clone() if isinstance(v, torch.Tensor) else v)
                                        for k, v in kwargs.items()})
    return copies


_AMP = [{}, {"grad_scale": torch.tensor(4.0)},
        {"grad_scale": torch.tensor(4.0), "found_inf": torch.tensor(0.0)},
        {"grad_scale": torch.tensor(4.0), "found_inf": torch.tensor(1.0)}]


@pytest.mark.parametrize("amp", _AMP, ids=["plain", "scaled", "no_inf", "inf"])
@pytest.mark.parametrize("options", [
    dict(momentum=0.9, nesterov=False, is_first_step=False, weight_decay=0.0, maximize=False),
    dict(momentum=0.9, nesterov=True, is_first_step=True, weight_decay=0.1, maximize=True),
    dict(momentum=0.0, nesterov=False, is_first_step=False, weight_decay=0.1, maximize=False),
])
@pytest.mark.parametrize("lr", [0.1, torch.tensor(0.1)], ids=["float_lr", "tensor_lr"])
def test_fused_sgd(recorded, options, amp, lr):
    lists = _lists(3)
    if not options["momentum"]:
        lists[2] = []  # the optimizer passes no buffers without momentum
    kwargs = dict(options, dampening=0.1, lr=lr, **amp)
    native, ours = _run_both(A._fused_sgd_, _fn(recorded, "aten::_fused_sgd_"), lists, (), kwargs)
    torch.testing.assert_close(ours, native)


@pytest.mark.parametrize("name", ["aten::_fused_adam_", "aten::_fused_adamw_"])
@pytest.mark.parametrize("amp", _AMP, ids=["plain", "scaled", "no_inf", "inf"])
@pytest.mark.parametrize("amsgrad, maximize", [(False, False), (True, True)])
@pytest.mark.parametrize("lr", [0.01, torch.tensor(0.01)], ids=["float_lr", "tensor_lr"])
def test_fused_adam(recorded, name, amp, amsgrad, maximize, lr):
    params, grads, avgs, sqs, maxes = _lists(5)
    sqs, maxes = [s.abs() for s in sqs], [m.abs() for m in maxes]
    steps = [torch.tensor(3.0), torch.tensor(7.0)]
    kwargs = dict(lr=lr, beta1=0.9, beta2=0.99, weight_decay=0.05, eps=1e-8, amsgrad=amsgrad,
                  maximize=maximize, **amp)
    native, ours = _run_both(getattr(A, name[6:]), _fn(recorded, name),
                             [params, grads, avgs, sqs, maxes if amsgrad else [], steps], (), kwargs)
    torch.testing.assert_close(ours, native)


@pytest.mark.parametrize("amp", _AMP, ids=["plain", "scaled", "no_inf", "inf"])
@pytest.mark.parametrize("lr", [0.1, torch.tensor(0.1)], ids=["float_lr", "tensor_lr"])
def test_fused_adagrad(recorded, amp, lr):
    params, grads, sums = _lists(3)
    sums = [s.abs() for s in sums]
    steps = [torch.tensor(3.0), torch.tensor(1.0)]
    kwargs = dict(lr=lr, lr_decay=0.01, weight_decay=0.1, eps=1e-10, maximize=True, **amp)
    native, ours = _run_both(A._fused_adagrad_, _fn(recorded, "aten::_fused_adagrad_"),
                             [params, grads, sums, steps], (), kwargs)
    torch.testing.assert_close(ours, native)


def test_fbgemm_complete_cumsum(recorded):
    got = _fn(recorded, "fbgemm::asynchronous_complete_cumsum")(torch.tensor([3, 1, 2], dtype=torch.int32))
    assert got.tolist() == [0, 3, 4, 6] and got.dtype == torch.int32


@pytest.mark.parametrize("mode, warnings", [(1, 3), (2, 0)])
def test_fbgemm_bounds_check_zeroes_out_of_range_indices(recorded, mode, warnings):
    """Two tables (5 and 3 rows), batch 2: bags [0, 7 | 2 | 1, 4 | -1]."""
    indices = torch.tensor([0, 7, 2, 1, 4, -1])
    warning = torch.zeros(1, dtype=torch.int64)
    _fn(recorded, "fbgemm::bounds_check_indices")(torch.tensor([5, 3]), indices,
                                                  torch.tensor([0, 2, 3, 5, 6]), mode, warning)
    assert indices.tolist() == [0, 0, 2, 1, 0, 0]
    assert warning.item() == warnings


def test_pin_memory_copies_and_record_stream_does_nothing(recorded):
    x = torch.randn(3)
    copy = _fn(recorded, "aten::pin_memory")(x)
    assert torch.equal(copy, x) and copy.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    assert _fn(recorded, "aten::record_stream")(x, None) is None
