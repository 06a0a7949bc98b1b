"""Which kernel ``scaled_dot_product_attention`` runs on a CUDA GPU, by torch's own rules.

A Python reading of ``select_sdp_backend`` in aten/src/ATen/native/transformers/cuda/
sdp_utils.cpp (and sdp_utils_cpp.h), for dense inputs, so a capture on fake ``cpu`` tensors can
dispatch as the target GPU would (actors/capture/fake/cuda_attention.py). Each rule names the C++
check it mirrors. What is assumed, not read from a device:

* the priority order is torch's default: flash, memory-efficient, math (then cuDNN, which math
  always precedes while it is enabled). A CUDA 13 build with cuDNN > 9.15 on sm90/sm10x puts
  cuDNN first; its tensors (output, a float32 logsumexp of B x H x L, philox seed and offset)
  are flash's bytes, so the memory answer holds either way;
* torch was built with flash and memory-efficient attention (every official CUDA wheel is);
* the user's ``torch.backends.cuda.enable_*_sdp`` switches (and ``sdpa_kernel``) are read from
  this process, as torch reads them.

The CPU's own choice (``cpu_backend``) is the one torch makes for CPU tensors
(aten/src/ATen/native/transformers/sdp_utils_cpp.cpp): its flash kernel takes no dropout.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from actors.gpu_arch import GpuArch
from actors.trace.dtypes import dtype_name

FLASH, EFFICIENT, MATH = "flash", "efficient", "math"
CPU_FLASH, CPU_MATH = "cpu_flash", "cpu_math"
_HALF = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class SdpaCall:
    """The facts of one ``scaled_dot_product_attention`` call that the rules read."""

    q_shape: tuple[int, ...]
    k_shape: tuple[int, ...]
    v_shape: tuple[int, ...]
    dtype: torch.dtype
    last_strides: tuple[int, int, int]  # q, k, v stride(-1)
    offsets: tuple[int, int, int]  # q, k, v storage offsets (elements)
    has_mask: bool
    dropout_p: float
    is_causal: bool
    enable_gqa: bool
    requires_grad: bool  # grad mode on and q, k or v requires grad

    @classmethod
    def of(cls, q, k, v, attn_mask=None, dropout_p: float = 0.0, is_causal: bool = False,
           enable_gqa: bool = False) -> "SdpaCall":
        """The facts of a call on (fake) tensors."""
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        return cls(tuple(q.shape), tuple(k.shape), tuple(v.shape), q.dtype,
                   (q.stride(-1), k.stride(-1), v.stride(-1)),
                   (q.storage_offset(), k.storage_offset(), v.storage_offset()),
                   attn_mask is not None, float(dropout_p), bool(is_causal), bool(enable_gqa),
                   grad)

    @property
    def dense_4d(self) -> bool:
        return len(self.q_shape) == len(self.k_shape) == len(self.v_shape) == 4


@dataclass
class SdpaChoice:
    """The kernel torch picks, with why each one before it was passed over."""

    backend: str
    passed_over: dict[str, str] = field(default_factory=dict)


def _common(call: SdpaCall) -> str | None:
    """Checks flash and efficient share: check_tensor_shapes,
    check_nonzero_sequence_lengths_dense, check_batch_size_and_num_heads_dense."""
    if not call.dense_4d:
        return "q, k and v must be 4-D (batch, heads, seq, head_dim)"
    (bq, hq, lq, _), (bk, hk, lk, _), (bv, hv, lv, _) = call.q_shape, call.k_shape, call.v_shape
    if min(lq, lk, lv) == 0:
        return "a sequence length is 0"
    if not bq == bk == bv:
        return "q, k and v batch sizes differ"
    if call.enable_gqa:
        if hq % hk or hk != hv:
            return f"grouped-query heads: {hq} query heads over {hk} key and {hv} value heads"
    elif not hq == hk == hv:
        return f"q, k and v head counts differ ({hq}, {hk}, {hv}) without enable_gqa"
    return None


def flash_refusal(call: SdpaCall, arch: GpuArch) -> str | None:
    """Why flash attention cannot run the call (can_use_flash_attention), or None."""
    if not torch.backends.cuda.flash_sdp_enabled():
        return "disabled (torch.backends.cuda.enable_flash_sdp)"
    why = _common(call)
    if why:
        return why
    if call.has_mask:  # check_for_attn_mask
        return "an attn_mask is given"
    dq, dk, dv = call.q_shape[-1], call.k_shape[-1], call.v_shape[-1]
    if not (dq == dk == dv and dq <= 256):  # check_head_dim_size_flash
        return f"head dims {dq}, {dk}, {dv}: must be equal and <= 256"
    major, minor = arch.capability
    restricted = (8, 6) <= (major, minor) <= (8, 9) or (12, 0) <= (major, minor) <= (12, 1)
    if call.requires_grad and restricted and not (  # ..._on_sm86_89_or_120
            dq <= 192 or (call.dropout_p == 0 and dq > 224)):
        return f"training with head_dim {dq} on {arch}"
    if call.is_causal and call.q_shape[2] != call.k_shape[2]:  # ..._causal_non_square_seqlens
        return "is_causal with seqlen_q != seqlen_k"
    if call.dtype not in _HALF:  # check_dtypes_low_precision
        return f"dtype {dtype_name(str(call.dtype))}: fp16 or bf16 only"
    if any(s != 1 for s, n in zip(call.last_strides, (dq, dk, dv)) if n != 1):
        return "the last dimension is not contiguous"
    return None


def efficient_refusal(call: SdpaCall, arch: GpuArch) -> str | None:
    """Why memory-efficient attention cannot run the call (can_use_mem_efficient_attention)."""
    if not torch.backends.cuda.mem_efficient_sdp_enabled():
        return "disabled (torch.backends.cuda.enable_mem_efficient_sdp)"
    why = _common(call)
    if why:
        return why
    # minimum_gemm_alignment on sm80+: 8 elements in half precision, 4 in float32
    align = 8 if call.dtype in _HALF else 4
    dq, dk, dv = call.q_shape[-1], call.k_shape[-1], call.v_shape[-1]
    if dq != dk or dq % align or dv % align:  # check_head_dim_size_mem_efficient
        return f"head dims {dq}, {dk}, {dv}: q and k equal, each a multiple of {align}"
    if any(off % align for off in call.offsets):  # check_data_ptr_alignment_mem_efficient
        return f"a storage offset is not a multiple of {align} elements"
    if any(s != 1 for s in call.last_strides):  # check_last_dim_stride_equals_1_dense
        return "the last dimension is not contiguous"
    if call.dtype not in (*_HALF, torch.float32):
        return f"dtype {dtype_name(str(call.dtype))}: fp16, bf16 or fp32 only"
    return None


def choose_cuda_backend(call: SdpaCall, arch: GpuArch) -> SdpaChoice:
    """The kernel CUDA's ``select_sdp_backend`` picks on ``arch``: flash, efficient or math
    (``math`` also when every kernel is disabled: torch would raise there)."""
    passed = {}
    for backend, refusal in ((FLASH, flash_refusal), (EFFICIENT, efficient_refusal)):
        why = refusal(call, arch)
        if why is None:
            return SdpaChoice(backend, passed)
        passed[backend] = why
    return SdpaChoice(MATH, passed)


def cpu_backend(call: SdpaCall) -> str:
    """The kernel torch picks for CPU tensors (use_flash_attention_cpp): its flash kernel for
    4-D floating inputs with equal head dims and no dropout, else math."""
    if not call.dense_4d or call.dropout_p > 0 or not call.dtype.is_floating_point:
        return CPU_MATH
    if not call.q_shape[-1] == call.k_shape[-1] == call.v_shape[-1]:
        return CPU_MATH
    if call.q_shape[1] != call.k_shape[1] and not call.enable_gqa:
        return CPU_MATH
    return CPU_FLASH
