"""Device translation: ops of a CUDA trace that cannot run on the replay device run as an
equivalent with the same semantics and the same outputs (shapes, dtypes, count).

`TRANSLATIONS` is the one table: recorded op name -> `Translation`. A translation applies when
the recorded op has no kernel for the replay device (cudnn batch norm's backward on cpu,
fused SGD on meta, an fbgemm op when fbgemm_gpu is not loaded), for entries marked
``off_cuda``, on every device but CUDA (the op dispatches there, then needs a GPU), and for
entries marked ``everywhere``, on every device (``detach_``: the replay's tensors are views). A builder
may decline one op (packed variable-length attention, an attention-bias gradient); the op then
stays skipped with that reason. Outputs the equivalent does not produce (cudnn's reserve
space, philox seeds) are zero stand-ins of the recorded shape.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

import torch

from actors.replay.ops import resolve
from actors.replay.ops import translate_attention as attention
from actors.replay.ops import translate_optim as optim
from actors.replay.ops.recorded import Outputs, binding, input_arg, schema_of
from actors.trace.model import Op, TensorArg
from actors.trace.op_schema import OpSchema

aten = torch.ops.aten


@dataclass(frozen=True)
class Translation:
    """What runs instead of one recorded op."""

    target: str  # the equivalent, as reports and the README name it
    # (op, schema, device) -> a callable taking the recorded arguments, or a str: why this
    # particular op has no equivalent (it then stays skipped with that reason)
    build: Callable
    off_cuda: bool = False  # replace on every non-CUDA device, even where the op dispatches
    everywhere: bool = False  # replace on every device (the recorded op cannot run in a replay)


# --- batch norm and convolution ------------------------------------------------------------
def _batch_norm(op: Op, schema: OpSchema, device):
    outputs = Outputs(op, device)  # cudnn's 4th output, the reserve space, is a stand-in

    def run(input, weight, bias, running_mean, running_var, training, exponential_average_factor,
            epsilon):
        out, mean, invstd = aten.native_batch_norm.default(
            input, weight, bias, running_mean, running_var, training, exponential_average_factor,
            epsilon)
        # in eval the GPU kernels save no statistics (empty tensors), and nothing reads them
        return outputs({0: out, 1: mean, 2: invstd} if training else {0: out})
    return run


def _batch_norm_backward(op: Op, schema: OpSchema, device):
    # cudnn/miopen save the inverse standard deviation, like native_batch_norm; their backward
    # only runs in training (autograd calls native_batch_norm_backward in eval)
    def run(input, grad_output, weight, running_mean, running_var, save_mean, save_var, epsilon,
            reserveSpace=None):
        return aten.native_batch_norm_backward.default(
            grad_output, input, weight, running_mean, running_var, save_mean, save_var, True,
            epsilon, [True, True, True])
    return run


def _conv(transposed: bool, bias_arg: bool, then=None):
    """cudnn/miopen convolutions take (padding, [output_padding,] stride, dilation); aten's
    convolution takes (stride, padding, dilation, transposed, output_padding)."""
    def build(op: Op, schema: OpSchema, device):
        def run(self, weight, *args):
            bias, args = (args[0], args[1:]) if bias_arg else (None, args)
            padding, args = args[0], args[1:]
            output_padding, args = (args[0], args[1:]) if transposed else ([0] * len(padding), args)
            stride, dilation, groups = args[:3]
            return aten.convolution.default(self, weight, bias, stride, padding, dilation,
                                            transposed, output_padding, groups)
        return run
    return build


def _conv_relu(add: bool):
    """``cudnn_convolution_relu`` / ``_add_relu``: relu(conv(x) [+ alpha * z]), conv with bias."""
    def build(op: Op, schema: OpSchema, device):
        def run(self, weight, *args):
            z, alpha, args = (args[0], args[1], args[2:]) if add else (None, None, args)
            bias, stride, padding, dilation, groups = args
            y = aten.convolution.default(self, weight, bias, stride, padding, dilation, False,
                                         [0] * len(padding), groups)
            if add:
                y = y.add_(z, alpha=1 if alpha is None else alpha)
            return y.relu_()
        return run
    return build


# --- host memory and streams: nothing to do off CUDA ------------------------------------------
def _pin_memory(op: Op, schema: OpSchema, device):
    """A pinned copy is an ordinary copy off CUDA; a tensor already pinned comes back as is."""
    src, out = op.inputs[0], op.outputs[0] if op.outputs else None
    aliased = type(src) is TensorArg and type(out) is TensorArg and src.storage_id == out.storage_id

    def run(self, device=None):
        return self if aliased else aten.clone.default(self)
    return run


def _record_stream(op: Op, schema: OpSchema, device):
    """Marks a tensor in use on another stream for the caching allocator: no streams here."""
    def run(self, s=None):
        return None
    return run


def _detach_inplace(op: Op, schema: OpSchema, device):
    """Drops a tensor's autograd history in place. Replayed tensors carry none, and the store
    hands the op a view of its storage, on which autograd refuses ``detach_`` ("Can't detach
    views in-place"; a foreach optimizer detaches a 0-dim step this way): the tensor as is."""
    def run(self):
        return self
    return run


# --- fbgemm ops whose semantics are a line of torch (when fbgemm_gpu is not loaded) ----------
def _complete_cumsum(op: Op, schema: OpSchema, device):
    inp = op.inputs[0] if op.inputs else None
    if type(inp) is not TensorArg or len(inp.shape) != 1:
        return "only a 1-D input has a torch equivalent"

    def run(t_in):
        sums = torch.cumsum(t_in, 0, dtype=t_in.dtype)
        return torch.cat([sums.new_zeros(1), sums])
    return run


def _bounds_check_indices(op: Op, schema: OpSchema, device):
    """Out-of-range indices of each table become 0 (and are counted in ``warning``). A fatal
    mode does not raise here: synthetic data must not end a replay."""
    for name in ("B_offsets", "b_t_map"):
        if type(input_arg(op, schema, name)) is TensorArg:
            return f"variable batch sizes ({name}) are not supported"

    def run(rows_per_table, indices, offsets, bounds_check_mode, warning, weights=None, *flags):
        # flags: later fbgemm versions' max_B, kernel version, ...: they do not change the result
        if bounds_check_mode == 3:  # BoundsCheckMode.NONE
            return None
        num_tables = max(1, rows_per_table.numel())
        offsets.clamp_(0, indices.numel())
        batch = max(1, (offsets.numel() - 1) // num_tables)
        positions = torch.arange(indices.numel(), device=indices.device)
        bag = torch.searchsorted(offsets[1:], positions, right=True)
        table = (bag // batch).clamp_(max=num_tables - 1)
        bad = (indices < 0) | (indices >= rows_per_table.to(indices.dtype)[table])
        indices.masked_fill_(bad, 0)
        if bounds_check_mode == 1:  # BoundsCheckMode.WARNING
            warning.add_(bad.sum().to(warning.dtype))
        return None
    return run


_BN, _BN_BWD = "aten::native_batch_norm", "aten::native_batch_norm_backward"
_CONV = "aten::convolution"
_SDPA, _SDPA_BWD = attention.TARGET_FWD, attention.TARGET_BWD

TRANSLATIONS: dict[str, Translation] = {
    "aten::cudnn_batch_norm": Translation(_BN, _batch_norm),
    "aten::cudnn_batch_norm_backward": Translation(_BN_BWD, _batch_norm_backward),
    "aten::miopen_batch_norm": Translation(_BN, _batch_norm),
    "aten::miopen_batch_norm_backward": Translation(_BN_BWD, _batch_norm_backward),
    "aten::cudnn_convolution": Translation(_CONV, _conv(False, False)),
    "aten::cudnn_convolution_transpose": Translation(_CONV, _conv(True, False)),
    "aten::cudnn_convolution_relu": Translation(f"{_CONV} + relu", _conv_relu(False)),
    "aten::cudnn_convolution_add_relu": Translation(f"{_CONV} + add + relu", _conv_relu(True)),
    "aten::miopen_convolution": Translation(_CONV, _conv(False, True)),
    "aten::miopen_depthwise_convolution": Translation(_CONV, _conv(False, True)),
    "aten::miopen_convolution_transpose": Translation(_CONV, _conv(True, True)),
    "aten::miopen_convolution_relu": Translation(f"{_CONV} + relu", _conv_relu(False)),
    "aten::miopen_convolution_add_relu": Translation(f"{_CONV} + add + relu", _conv_relu(True)),
    # fused attention -> the CPU flash kernel (translate_attention explains the choice)
    "aten::_scaled_dot_product_flash_attention": Translation(_SDPA, attention.sdpa_flash),
    "aten::_scaled_dot_product_flash_attention_backward":
        Translation(_SDPA_BWD, attention.sdpa_flash_backward),
    "aten::_scaled_dot_product_efficient_attention": Translation(_SDPA, attention.sdpa_efficient),
    "aten::_scaled_dot_product_efficient_attention_backward":
        Translation(_SDPA_BWD, attention.sdpa_efficient_backward),
    "aten::_scaled_dot_product_cudnn_attention": Translation(_SDPA, attention.sdpa_cudnn),
    "aten::_scaled_dot_product_cudnn_attention_backward":
        Translation(_SDPA_BWD, attention.sdpa_cudnn_backward),
    "aten::_flash_attention_forward": Translation(_SDPA, attention.flash_forward),
    "aten::_flash_attention_backward": Translation(_SDPA_BWD, attention.flash_backward),
    "aten::_efficient_attention_forward": Translation(_SDPA, attention.efficient_forward),
    "aten::_efficient_attention_backward": Translation(_SDPA_BWD, attention.efficient_backward),
    # fused optimizers without a kernel here (in torch 2.13: on meta) -> their foreach form
    "aten::_fused_sgd_": Translation("aten::_foreach_* (SGD)", optim.sgd),
    "aten::_fused_adam_": Translation("aten::_foreach_* (Adam)", optim.adam(decoupled=False)),
    "aten::_fused_adamw_": Translation("aten::_foreach_* (AdamW)", optim.adam(decoupled=True)),
    "aten::_fused_adagrad_": Translation("aten::_foreach_* (Adagrad)", optim.adagrad),
    "aten::pin_memory": Translation("aten::clone", _pin_memory, off_cuda=True),
    "aten::_pin_memory": Translation("aten::clone", _pin_memory, off_cuda=True),
    "aten::record_stream": Translation("nothing (no streams)", _record_stream, off_cuda=True),
    "aten::detach_": Translation("nothing (no autograd in a replay)", _detach_inplace,
                                 everywhere=True),
    "fbgemm::asynchronous_complete_cumsum": Translation("aten::cumsum", _complete_cumsum),
    "fbgemm::bounds_check_indices": Translation("aten::masked_fill_", _bounds_check_indices),
}


def lookup(op: Op, device: torch.device) -> resolve.ResolvedOp | resolve.Unresolved | None:
    """The binding of the equivalent when ``op`` cannot run on ``device`` and the table has one
    (Unresolved with the reason when its builder declines); None when the op runs as recorded."""
    entry = TRANSLATIONS.get(op.name)
    if entry is None or device.type == "cuda" and entry.off_cuda:
        return None
    if not (entry.off_cuda or entry.everywhere) and runs_natively(op.name, op.schema, device.type):
        return None
    schema = schema_of(op)
    if isinstance(schema, str):
        return resolve.Unresolved(op.name, resolve.SKIPPED, f"{op.name}: {schema}")
    fn = entry.build(op, schema, device)
    why = fn if isinstance(fn, str) else _unknown_argument(op, schema, fn)
    if why:
        return resolve.Unresolved(op.name, resolve.SKIPPED,
                                  f"{op.name}: {why} (no equivalent on {device.type})")
    return binding(schema, fn, translated_from=op.name)


def _unknown_argument(op: Op, schema: OpSchema, fn) -> str | None:
    """A recorded argument the equivalent does not take (an option of another torch version),
    unless it was recorded as None."""
    params = inspect.signature(fn).parameters
    varargs = any(p.kind is p.VAR_POSITIONAL for p in params.values())
    positional = sum(p.kind is p.POSITIONAL_OR_KEYWORD for p in params.values())
    for pos, (sarg, value) in enumerate(zip(schema.args, op.inputs)):
        if type(value) is not TensorArg and value.kind == "none":
            continue
        if sarg.kwarg_only and sarg.name not in params or \
                not sarg.kwarg_only and pos >= positional and not varargs:
            return f"argument {sarg.name!r} is not supported"
    return None


_BACKEND_KEYS = {"cpu": "CPU", "meta": "Meta", "cuda": "CUDA"}
_COMPOSITE_KEYS = ("CompositeImplicitAutograd", "CompositeExplicitAutograd",
                   "CompositeExplicitAutogradNonFunctional")


@lru_cache(maxsize=1024)
def runs_natively(name: str, schema: str, device_type: str) -> bool:
    """Whether this torch has a kernel for the recorded overload on ``device_type``."""
    resolved = resolve.resolve_op(name, schema)
    if not isinstance(resolved, resolve.ResolvedOp):
        return False
    overload = resolved.overload.name()
    keys = (_BACKEND_KEYS.get(device_type, device_type.upper()),) + _COMPOSITE_KEYS
    return any(torch._C._dispatch_has_kernel_for_dispatch_key(overload, k) for k in keys)
