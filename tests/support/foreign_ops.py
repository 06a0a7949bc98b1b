"""Traces of ops a CPU replay cannot run as recorded, for the translation and stand-in tests.

* `record` runs a program under the Execution Trace observer (the real recorder).
* `gpu_kernels_on_meta`: cudnn/miopen batch norm and the fused attention kernels, forward and
  backward (autograd calls the backward kernels), recorded on meta: their meta kernels give
  exactly the output shapes the CUDA kernels produce.
* `fused_optimizers_on_cpu`: every fused optimizer overload, recorded on CPU.
* `without_kernels`: ops no kernel here can run at all (cudnn/miopen convolutions, fbgemm ops,
  pin_memory, record_stream), hand-written with output shapes from the convolution formula.
* `fill` / `run_step` put random tensors in a compiled step's slots (and call it).
"""
from __future__ import annotations

import os

from pathlib import Path

import torch
from torch.profiler import ExecutionTraceObserver

from actors.replay.ops import resolve
from actors.trace import load_trace
from actors.trace.model import TensorArg
from tests.support import et_json

A = torch.ops.aten


def record(path: Path, program) -> Path:
    """Run ``program()`` under the ET observer into ``path`` (without tensor ranges: they
    cannot be read from meta tensors, and the observer drops the inputs after one)."""
    os.environ.pop("ENABLE_PYTORCH_EXECUTION_TRACE_SAVE_INTEGRAL_TENSOR_RANGE", None)
    et = ExecutionTraceObserver()
    et.register_callback(str(path))
    et.start()
    try:
        program()
    finally:
        et.stop()
        et.unregister_callback()
    return path


def _meta(*shape, dtype=torch.float32, grad=True):
    return torch.empty(*shape, device="meta", dtype=dtype).requires_grad_(grad and dtype.is_floating_point)


def gpu_kernels_on_meta(path: Path):
    """Batch norm (train and eval) and the five fused attention families; L=16 != S=24."""
    def program():
        x, w, b = _meta(2, 3, 5, 5), _meta(3), _meta(3)
        for op in (A.cudnn_batch_norm, A.miopen_batch_norm):
            op(x, w, b, _meta(3, grad=False), _meta(3, grad=False), True, 0.1, 1e-5)[0].sum().backward()
        A.cudnn_batch_norm(x, w, b, _meta(3, grad=False), _meta(3, grad=False), False, 0.1, 1e-5)
        q, k, v, v6 = _meta(2, 4, 16, 8), _meta(2, 4, 24, 8), _meta(2, 4, 24, 8), _meta(2, 4, 24, 6)
        bias = _meta(2, 4, 16, 24, grad=False)
        A._scaled_dot_product_flash_attention(q, k, v, 0.0, False)[0].sum().backward()
        A._scaled_dot_product_efficient_attention(q, k, v6, bias, True, 0.0, False)[0].sum().backward()
        A._scaled_dot_product_cudnn_attention(q, k, v6, None, True, 0.0, True)[0].sum().backward()
        ql, kl, vl, v6l = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v, v6))
        A._flash_attention_forward(ql, kl, vl, None, None, 16, 24, 0.0, False, False)[0].sum().backward()
        A._efficient_attention_forward(ql, kl, v6l, bias, None, None, None, None, 0.0, 1, True)[0] \
            .sum().backward()
    return load_trace(record(path, program))


def fused_optimizers_on_cpu(path: Path):
    def lists(n=2):
        return [torch.randn(3) for _ in range(n)]

    def steps():
        return [torch.tensor(2.0) for _ in range(2)]

    def program():
        lr = torch.tensor(0.01)
        adam = dict(beta1=0.9, beta2=0.99, weight_decay=0.01, eps=1e-8, amsgrad=False, maximize=False)
        sgd = dict(weight_decay=0.0, momentum=0.9, dampening=0.0, nesterov=False, maximize=False,
                   is_first_step=False)
        adagrad = dict(lr_decay=0.0, weight_decay=0.0, eps=1e-10, maximize=False)
        for op in (A._fused_adam_, A._fused_adamw_):
            op.default(lists(), lists(), lists(), lists(), [], steps(), lr=0.01, **adam)
            op.tensor_lr(lists(), lists(), lists(), lists(), [], steps(), lr=lr, **adam)
        A._fused_sgd_.default(lists(), lists(), lists(), lr=0.01, **sgd)
        A._fused_sgd_.tensor_lr(lists(), lists(), lists(), lr=lr, **sgd)
        A._fused_adagrad_.default(lists(), lists(), lists(), steps(), lr=0.01, **adagrad)
        A._fused_adagrad_.tensor_lr(lists(), lists(), lists(), steps(), lr=lr, **adagrad)
    return load_trace(record(path, program))


def _conv_out(size, kernel, stride, padding, dilation):
    return (size + 2 * padding - dilation * (kernel - 1) - 1) // stride + 1


def _conv_t_out(size, kernel, stride, padding, dilation, output_padding):
    return (size - 1) * stride - 2 * padding + dilation * (kernel - 1) + output_padding + 1


def _ints(values):
    return et_json.scalar(list(values), "GenericList[" + ",".join(["Int"] * len(values)) + "]")


def without_kernels(tmp_path: Path):
    """Convolutions with asymmetric stride/padding/dilation (a swapped argument changes the
    shape), groups=2; fbgemm ops as recorded in the public DLRM trace; pin_memory;
    record_stream. Shapes come from the convolution formula, not from a torch kernel."""
    t, i = et_json.tensor, _ints
    x = t(1, 1, 2 * 4 * 9 * 10, shape=[2, 4, 9, 10])
    w = t(2, 2, 6 * 2 * 3 * 3, shape=[6, 2, 3, 3])
    bias = t(3, 3, 6, shape=[6])
    stride, padding, dilation = [2, 1], [1, 2], [1, 2]
    h, wd = (_conv_out(n, 3, s, p, d) for n, s, p, d in zip((9, 10), stride, padding, dilation))
    y = lambda tid: t(tid, tid, 2 * 6 * h * wd, shape=[2, 6, h, wd])  # noqa: E731
    z = t(4, 4, 2 * 6 * h * wd, shape=[2, 6, h, wd])
    wt = t(5, 5, 4 * 3 * 3 * 3, shape=[4, 3, 3, 3])  # transposed: (in, out / groups, kh, kw)
    out_pad = [1, 0]
    ht, wt_ = (_conv_t_out(n, 3, s, p, d, o) for n, s, p, d, o in
               zip((9, 10), stride, padding, dilation, out_pad))
    yt = lambda tid: t(tid, tid, 2 * 6 * ht * wt_, shape=[2, 6, ht, wt_])  # noqa: E731
    scalar, groups = et_json.scalar, et_json.scalar(2)
    flags3, flags2 = [scalar(False, "Bool")] * 3, [scalar(False, "Bool")] * 2
    alpha = scalar(0.5, "Double")
    schema = lambda name: str(getattr(A, name).default._schema)  # noqa: E731
    nodes = [
        ("cudnn_convolution", [x, w, i(padding), i(stride), i(dilation), groups, *flags3], [y(10)]),
        ("cudnn_convolution_transpose",
         [x, wt, i(padding), i(out_pad), i(stride), i(dilation), groups, *flags3], [yt(11)]),
        ("cudnn_convolution_relu", [x, w, bias, i(stride), i(padding), i(dilation), groups], [y(12)]),
        ("cudnn_convolution_add_relu",
         [x, w, z, alpha, bias, i(stride), i(padding), i(dilation), groups], [y(13)]),
        ("miopen_convolution", [x, w, bias, i(padding), i(stride), i(dilation), groups, *flags2], [y(14)]),
        ("miopen_depthwise_convolution",
         [x, w, bias, i(padding), i(stride), i(dilation), groups, *flags2], [y(15)]),
        ("miopen_convolution_transpose",
         [x, wt, bias, i(padding), i(out_pad), i(stride), i(dilation), groups, *flags2], [yt(16)]),
        ("miopen_convolution_relu", [x, w, bias, i(stride), i(padding), i(dilation), groups], [y(17)]),
        ("miopen_convolution_add_relu",
         [x, w, z, alpha, bias, i(stride), i(padding), i(dilation), groups], [y(18)]),
        ("pin_memory", [x, scalar("<None>", "None")], [t(19, 19, 2 * 4 * 9 * 10, shape=[2, 4, 9, 10])]),
        ("_pin_memory", [x, scalar("<None>", "None")], [t(20, 20, 2 * 4 * 9 * 10, shape=[2, 4, 9, 10])]),
        ("record_stream", [x, scalar("<Stream>", "Stream")], []),
    ]
    lengths = t(30, 30, 384, dtype="int", shape=[384])
    indices = t(31, 31, 768, dtype="long int", shape=[768])
    offsets = t(32, 32, 385, dtype="long int", shape=[385])
    fbgemm = [
        ("fbgemm::asynchronous_complete_cumsum", "fbgemm::asynchronous_complete_cumsum(Tensor t_in) -> Tensor",
         [lengths], [t(33, 33, 385, dtype="int", shape=[385])]),
        ("fbgemm::bounds_check_indices",
         "fbgemm::bounds_check_indices(Tensor rows_per_table, Tensor(a!) indices, Tensor(b!) offsets, "
         "int bounds_check_mode, Tensor(c!) warning, Tensor(d!)? weights=None) -> ()",
         [t(34, 34, 3, dtype="long int", shape=[3]), indices, offsets, scalar(1),
          t(35, 35, 1, dtype="long int", shape=[1]), scalar("<None>", "None")], []),
    ]
    written = [et_json.node(100 + k, f"aten::{name}", inputs=ins, outputs=outs, schema=schema(name))
               for k, (name, ins, outs) in enumerate(nodes)]
    written += [et_json.node(200 + k, name, inputs=ins, outputs=outs, schema=sch)
                for k, (name, sch, ins, outs) in enumerate(fbgemm)]
    return load_trace(et_json.write_trace(tmp_path, [contiguous_strides(n) for n in written]))


def contiguous_strides(node: dict) -> dict:
    """et_json writes stride [1] for every tensor; give multi-dimensional ones their real
    (contiguous) strides so the replay can materialize them."""
    for side in (node["inputs"], node["outputs"]):
        side["strides"] = [torch.empty(shape, device="meta").stride()
                           if type_str.startswith("Tensor") else []
                           for shape, type_str in zip(side["shapes"], side["types"])]
    return node


def random_tensor(t: TensorArg, device) -> torch.Tensor:
    """Random floats, zeros for integers (a safe index) and booleans."""
    dtype = resolve.torch_dtype(t.dtype)
    if dtype.is_floating_point:
        return torch.randn(t.shape, dtype=dtype, device=device)
    return torch.zeros(t.shape, dtype=dtype, device=device)


def fill(step, device) -> tuple[list, dict]:
    """A compiled compute step's arguments with random tensors in its slots."""
    args = list(step.template)
    for pos, t in step.tensor_slots:
        args[pos] = random_tensor(t, device)
    for pos, tensors in step.list_slots:
        args[pos] = [None if t is None else random_tensor(t, device) for t in tensors]
    kwargs = dict(step.kwargs or {})
    for name, t in step.kw_tensor_slots:
        kwargs[name] = random_tensor(t, device) if type(t) is TensorArg else \
            [None if x is None else random_tensor(x, device) for x in t]
    return args, kwargs


def run_step(step, device):
    """Call a compiled compute step with random tensors in its slots."""
    args, kwargs = fill(step, device)
    return step.fn(*args, **kwargs)


def as_recorded(op, out) -> list:
    """(shape, dtype) or value per output, in the recorded outputs' terms, for comparison."""
    results = out if isinstance(out, tuple) else (() if out is None else (out,))
    return [(tuple(r.shape), str(r.dtype)[6:]) if isinstance(r, torch.Tensor) else r
            for r in results]


def recorded_outputs(op) -> list:
    return [(a.shape, a.dtype) if type(a) is TensorArg else a.value for a in op.outputs]
