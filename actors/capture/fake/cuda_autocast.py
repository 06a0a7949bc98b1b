"""Autocast as CUDA runs it, for a capture on fake tensors (which report ``cpu``).

Two things differ on fake from a GPU run of the same step:

* ``torch.autocast("cuda", ...)`` (and ``torch.cuda.amp.autocast``), the mixed-precision
  region of most GPU training code, is disabled with a warning where CUDA is absent: the step
  would be captured in float32. Within :func:`autocast_as_on_cuda` a region for ``cuda`` is
  entered for the device the fake tensors report.
* The cpu's autocast casts other ops than CUDA's (torch's ``autocast_mode.cpp``): CUDA runs
  ``layer_norm``, ``rms_norm``, ``exp``, ``pow``, the losses in float32 and gives ``softmax``,
  ``log_softmax``, ``sum``, ``cumsum`` a float32 output; the cpu leaves them in the input's
  dtype, and casts a whole ``cross_entropy`` input to float32 first (a float32 copy of the
  logits CUDA never makes). Within the block the cpu's autocast key runs CUDA's policy:
  :data:`CUDA_POLICY` for every op CUDA's key has a kernel for (where the cpu's kernel differs),
  a fallthrough for the ops only the cpu's key casts.

:data:`CUDA_POLICY` is torch's table (``AT_FORALL_*`` in ``aten/src/ATen/autocast_mode.h``) by
policy; tests/capture/test_cuda_autocast.py checks it names exactly the ops this torch
registers a CUDA autocast kernel for, so a torch that changes the table fails there.
"""
from __future__ import annotations

import warnings
from contextlib import contextmanager
from typing import Any, Callable

import torch
from torch.utils.weak import WeakIdKeyDictionary

LOWER, FP32, FP32_SET_OPT_DTYPE, FP32_APPEND_DTYPE, PROMOTE, BANNED = (
    "lower_precision_fp", "fp32", "fp32_set_opt_dtype", "fp32_append_dtype", "promote", "banned")
CUDA_POLICY: dict[str, tuple[str, ...]] = {
    LOWER: ("_convolution", "_convolution.deprecated", "conv1d", "conv2d", "conv3d", "conv_tbc",
            "conv_transpose1d", "conv_transpose2d.input", "conv_transpose3d.input",
            "convolution", "cudnn_convolution", "cudnn_convolution_transpose", "prelu",
            "addmm", "addmv", "addr", "matmul", "einsum", "mm", "mv", "linalg_vecdot", "linear",
            "addbmm", "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot",
            "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell", "gru_cell",
            "rnn_tanh_cell", "rnn_relu_cell", "_scaled_dot_product_flash_attention",
            "scaled_dot_product_attention"),
    FP32: ("acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p",
           "reciprocal", "rsqrt", "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor",
           "pow.Scalar", "softplus", "layer_norm", "native_layer_norm", "group_norm",
           "rms_norm", "frobenius_norm.dim", "nuclear_norm", "nuclear_norm.dim",
           "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss",
           "nll_loss2d", "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss",
           "huber_loss", "mse_loss", "margin_ranking_loss", "multilabel_margin_loss",
           "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss",
           "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm",
           "logsumexp", "upsample_nearest1d", "_upsample_nearest_exact1d", "upsample_nearest2d",
           "_upsample_nearest_exact2d", "upsample_nearest3d", "_upsample_nearest_exact3d",
           "upsample_linear1d", "upsample_bilinear2d", "_upsample_bilinear2d_aa",
           "upsample_trilinear3d", "upsample_bicubic2d", "_upsample_bicubic2d_aa"),
    FP32_SET_OPT_DTYPE: ("prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod",
                         "cumsum", "linalg_vector_norm", "linalg_matrix_norm",
                         "linalg_matrix_norm.str_ord", "sum", "sum.dim_IntList"),
    FP32_APPEND_DTYPE: ("norm.Scalar", "norm.ScalarOpt_dim"),
    PROMOTE: ("addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot",
              "grid_sampler", "index_put", "tensordot", "scatter_add"),
    BANNED: ("binary_cross_entropy",),
}
# The cpu's autocast runs these as CUDA does (same policy, a C++ kernel with its weight cache)
_SAME_ON_CPU = frozenset(("_convolution.deprecated", "conv1d", "conv2d", "conv3d", "conv_tbc",
                          "conv_transpose1d", "conv_transpose2d.input",
                          "conv_transpose3d.input", "prelu", "addmm", "matmul", "mm",
                          "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm",
                          "scaled_dot_product_attention", "nll_loss", "nll_loss2d", "mse_loss",
                          "cosine_embedding_loss", "hinge_embedding_loss", "poisson_nll_loss",
                          "smooth_l1_loss", "l1_loss", "huber_loss", "margin_ranking_loss",
                          "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss",
                          "kl_div", "multilabel_margin_loss", "binary_cross_entropy_with_logits",
                          "cdist"))
# Cast only on the cpu's key; CUDA's path reaches ops it casts itself (conv*.padding ends in
# _convolution; _addmm_activation and the cpu's fused RNN and attention kernels are cpu-only)
_CPU_ONLY_KEPT = frozenset(("conv1d.padding", "conv2d.padding", "conv3d.padding",
                            "_addmm_activation", "mkldnn_rnn_layer",
                            "_native_multi_head_attention"))
_CPU_KEY = "AutocastCPU"


def _op(name: str):
    base, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, base), overload or "default")


def _eligible(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.is_floating_point() \
        and t.dtype != torch.float64


class _Casts:
    """cached_cast: a float32 leaf parameter's low-precision copy is made once per autocast
    region, as torch's cache keeps it."""

    def __init__(self):
        self.cache = WeakIdKeyDictionary()

    def cast(self, value: Any, dtype: torch.dtype) -> Any:
        if isinstance(value, (list, tuple)):
            return type(value)(self.cast(v, dtype) for v in value)
        if not _eligible(value) or value.dtype == dtype:
            return value
        cacheable = value.dtype == torch.float32 and value.requires_grad and value.is_leaf \
            and not value._is_view() and torch.is_autocast_cache_enabled()
        if not cacheable:
            return value.to(dtype)
        if value not in self.cache:
            self.cache[value] = value.to(dtype)
        return self.cache[value]


def _widest(values, lower: torch.dtype) -> torch.dtype:
    for value in values:
        for t in value if isinstance(value, (list, tuple)) else (value,):
            if _eligible(t) and t.dtype == torch.float32:
                return torch.float32
    return lower


def _outside_region():
    """The autocast kernel's own guard: the op it redispatches to is not cast again."""
    return torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(
        torch._C.DispatchKey.AutocastCPU))


@contextmanager
def lower_precision_inputs(*tensors):
    """For a caller below the dispatcher's autocast kernel of a lower-precision op (the
    capture's SDPA runs CUDA's kernels directly): within a region, ``tensors`` cast to its
    dtype, the block run outside it, as that kernel does; outside one, as they are."""
    if not torch.is_autocast_enabled("cpu"):  # the fake tensors' regions are the cpu's
        yield tensors
        return
    dtype = torch.get_autocast_dtype("cpu")
    with _outside_region():
        yield tuple(t.to(dtype) if _eligible(t) and t.dtype != dtype else t for t in tensors)


def _kernel(policy: str, name: str, casts: _Casts) -> Callable:
    op = _op(name)
    dtype_at = next((i for i, a in enumerate(op._schema.arguments)
                     if a.name == "dtype" and not a.kwarg_only), None)
    with_dtype = {"norm.Scalar": "norm.ScalarOpt_dtype",
                  "norm.ScalarOpt_dim": "norm.ScalarOpt_dim_dtype"}.get(name)

    def kernel(*args, **kwargs):
        lower = torch.get_autocast_dtype("cpu")
        with _outside_region():
            if policy == LOWER:
                return op(*casts.cast(args, lower), **casts.cast(kwargs, lower))
            if policy == FP32:
                return op(*casts.cast(args, torch.float32), **casts.cast(kwargs, torch.float32))
            if policy == PROMOTE:
                to = _widest((*args, *kwargs.values()), lower)
                return op(*casts.cast(args, to), **casts.cast(kwargs, to))
            first = _eligible(args[0])
            if policy == FP32_APPEND_DTYPE:  # the overload with a dtype takes every argument
                return _op(with_dtype)(*_positional(op, args, kwargs),
                                       dtype=torch.float32 if first else args[0].dtype)
            # FP32_SET_OPT_DTYPE: a float32 output unless the caller chose a dtype
            if first and dtype_at is not None and len(args) > dtype_at:
                if args[dtype_at] is None:
                    args = (*args[:dtype_at], torch.float32, *args[dtype_at + 1:])
            elif first and kwargs.get("dtype") is None:
                kwargs = {**kwargs, "dtype": torch.float32}
            return op(*args, **kwargs)
    return kernel


def _positional(op, args: tuple, kwargs: dict) -> list:
    """``op``'s arguments as a positional list, its defaults filled in."""
    values = list(args)
    for argument in op._schema.arguments[len(args):]:
        values.append(kwargs[argument.name] if argument.name in kwargs
                      else argument.default_value)
    return values


def _banned(*args, **kwargs):
    raise RuntimeError("torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are "
                       "unsafe to autocast (CUDA's autocast refuses them): use "
                       "binary_cross_entropy_with_logits or BCEWithLogitsLoss")


def _cpu_registered() -> set[str]:
    """The aten ops the cpu's autocast key has a kernel of its own for."""
    names = set()
    for full in torch._C._dispatch_get_all_op_names():
        if full.startswith("aten::") and torch._C._dispatch_has_kernel_for_dispatch_key(
                full, _CPU_KEY):
            names.add(full[len("aten::"):])
    return names


@contextmanager
def _cuda_policy_on_cpu_key():
    casts = _Casts()
    lib = torch.library.Library("aten", "IMPL")
    cuda_ops = {name for names in CUDA_POLICY.values() for name in names}
    try:
        with warnings.catch_warnings():  # "overriding a previously registered kernel": meant
            warnings.simplefilter("ignore", UserWarning)
            for policy, names in CUDA_POLICY.items():
                for name in names:
                    if name not in _SAME_ON_CPU:
                        lib.impl(name, _banned if policy == BANNED
                                 else _kernel(policy, name, casts), _CPU_KEY)
            for name in _cpu_registered() - cuda_ops - _CPU_ONLY_KEPT:
                lib.impl(name, torch.library.fallthrough_kernel, _CPU_KEY)
        yield casts
    finally:
        lib._destroy()


@contextmanager
def autocast_as_on_cuda(on_region: Callable[[str, torch.dtype], None] | None = None):
    """Within the block, autocast regions for ``cuda`` act on the fake tensors and cast as
    CUDA's autocast does (see the module docstring), and asking whether cuda's region is on
    (and its dtype) answers for it; ``on_region(device_type, dtype)`` is called as each enabled
    region for ``cuda`` or ``cpu`` is made."""
    mode = torch.amp.autocast_mode
    autocast = mode.autocast
    cpu_init, cpu_clear, cpu_cast = autocast.__init__, torch.clear_autocast_cache, mode._cast
    asked = (torch.is_autocast_enabled, torch.get_autocast_dtype, torch.get_autocast_gpu_dtype,
             torch.set_autocast_enabled, torch.set_autocast_dtype)
    is_enabled, get_dtype, _, set_enabled, set_dtype = asked

    def init(self, device_type, dtype=None, enabled=True, cache_enabled=None):
        if device_type == "cuda" and dtype is None:
            dtype = get_dtype("cuda")  # CUDA's default (float16), not the cpu's (bfloat16)
        cpu_init(self, "cpu" if device_type == "cuda" else device_type, dtype, enabled,
                 cache_enabled)
        if on_region is not None and device_type in ("cuda", "cpu") and self._enabled:
            on_region(device_type, self.fast_dtype)

    # a library asking about cuda's region (torch.amp.custom_fwd(device_type="cuda"), the
    # no-argument form) hears about the region the fake tensors are in
    def is_autocast_enabled(device_type="cuda"):
        return is_enabled("cpu" if device_type == "cuda" else device_type)

    def get_autocast_dtype(device_type):
        return get_dtype("cpu" if device_type == "cuda" else device_type)

    # and what sets it back sets that region: Dynamo saves cuda's state around each frame it
    # compiles and restores it after (torch/_dynamo/output_graph.py); read from the cpu's and
    # written to cuda's, the cpu's bfloat16 would become cuda's default beyond the block
    def set_autocast_enabled(*args):
        if len(args) == 2 and args[0] == "cuda":
            args = ("cpu", args[1])
        set_enabled(*args)

    def set_autocast_dtype(device_type, dtype):
        set_dtype("cpu" if device_type == "cuda" else device_type, dtype)

    def cast(value, device_type, dtype):  # custom_fwd's cast_inputs: the fake tensors' device
        return cpu_cast(value, "cpu" if device_type == "cuda" else device_type, dtype)

    with _cuda_policy_on_cpu_key() as casts:
        def clear():  # the region's end: its cached weight copies go with torch's own
            casts.cache = WeakIdKeyDictionary()
            cpu_clear()

        autocast.__init__, torch.clear_autocast_cache, mode._cast = init, clear, cast
        torch.is_autocast_enabled, torch.get_autocast_dtype = is_autocast_enabled, \
            get_autocast_dtype
        torch.get_autocast_gpu_dtype = lambda: get_dtype("cpu")
        torch.set_autocast_enabled, torch.set_autocast_dtype = set_autocast_enabled, \
            set_autocast_dtype
        try:
            yield
        finally:
            autocast.__init__, torch.clear_autocast_cache, mode._cast = \
                cpu_init, cpu_clear, cpu_cast
            torch.is_autocast_enabled, torch.get_autocast_dtype, \
                torch.get_autocast_gpu_dtype, torch.set_autocast_enabled, \
                torch.set_autocast_dtype = asked
