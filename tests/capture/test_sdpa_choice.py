"""The CUDA kernel choice of scaled_dot_product_attention, rule by rule of torch's
sdp_utils.cpp (select_sdp_backend); on a GPU, against torch's own choice (test_cuda_dispatch)."""
from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from actors.capture.fake.sdpa_choice import (CPU_FLASH, CPU_MATH, EFFICIENT, FLASH, MATH, SdpaCall,
                                             choose_cuda_backend, cpu_backend)
from actors.gpu_arch import GpuArch

BF16, FP32 = torch.bfloat16, torch.float32


def call(q=(2, 8, 128, 64), k=None, v=None, dtype=BF16, mask=False, dropout=0.0, causal=False,
         gqa=False, grad=True, offsets=(0, 0, 0), strides=(1, 1, 1)) -> SdpaCall:
    k, v = k or q, v or k or q
    return SdpaCall(tuple(q), tuple(k), tuple(v), dtype, strides, offsets, mask, dropout,
                    causal, gqa, grad)


CASES = [
    # (what, call, arch, kernel): each row one rule of can_use_flash_attention /
    # can_use_mem_efficient_attention, in select_sdp_backend's order
    ("bf16 causal with dropout: flash takes dropout", call(dropout=0.1, causal=True), "sm90",
     FLASH),
    ("fp16 on A100", call(dtype=torch.float16), "sm80", FLASH),
    ("fp32: flash is fp16/bf16 only", call(dtype=FP32), "sm90", EFFICIENT),
    ("a mask: flash takes none (check_for_attn_mask)", call(mask=True), "sm90", EFFICIENT),
    ("head dim 72: flash pads it (<= 256)", call(q=(2, 8, 128, 72)), "sm90", FLASH),
    ("head dim 512 > 256: efficient", call(q=(2, 8, 128, 512)), "sm90", EFFICIENT),
    ("fp32 head dim 62: not a multiple of 4", call(q=(2, 8, 128, 62), dtype=FP32), "sm90", MATH),
    ("bf16 head dim 60, a mask: not a multiple of 8", call(q=(2, 8, 128, 60), mask=True), "sm90",
     MATH),
    ("value head dim differs: flash refuses", call(v=(2, 8, 128, 32)), "sm90", EFFICIENT),
    ("causal, Lq != Lk: flash refuses", call(k=(2, 8, 256, 64), causal=True), "sm90", EFFICIENT),
    ("sm86 training head dim 200", call(q=(2, 8, 128, 200)), "sm86", EFFICIENT),
    ("sm86 training head dim 240 without dropout", call(q=(2, 8, 128, 240)), "sm86", FLASH),
    ("sm86 training head dim 240 with dropout", call(q=(2, 8, 128, 240), dropout=0.1), "sm86",
     EFFICIENT),
    ("sm86 inference head dim 200", call(q=(2, 8, 128, 200), grad=False), "sm86", FLASH),
    ("sm90 training head dim 200", call(q=(2, 8, 128, 200)), "sm90", FLASH),
    ("sm120 like sm86", call(q=(2, 8, 128, 200)), "sm120", EFFICIENT),
    ("grouped-query heads with enable_gqa", call(k=(2, 2, 128, 64), gqa=True), "sm90", FLASH),
    ("grouped-query heads without enable_gqa", call(k=(2, 2, 128, 64)), "sm90", MATH),
    ("3-D inputs", call(q=(16, 128, 64)), "sm90", MATH),
    ("float64", call(dtype=torch.float64), "sm90", MATH),
    ("fp32 at an offset of 2 elements: efficient wants 4", call(dtype=FP32, offsets=(2, 0, 0)),
     "sm90", MATH),
    ("a non-contiguous last dim", call(strides=(2, 1, 1), dtype=FP32), "sm90", MATH),
]


@pytest.mark.parametrize("what, c, arch, kernel", CASES, ids=[c[0] for c in CASES])
def test_the_kernel_torch_picks(what, c, arch, kernel):
    choice = choose_cuda_backend(c, GpuArch(arch))
    assert choice.backend == kernel, choice.passed_over
    # every kernel before the chosen one says why it was passed over
    order = [FLASH, EFFICIENT, MATH]
    assert list(choice.passed_over) == order[:order.index(kernel)]


def test_a_user_disabling_a_kernel_is_respected():
    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
        choice = choose_cuda_backend(call(), GpuArch.sm90)
    assert choice.backend == EFFICIENT and "disabled" in choice.passed_over[FLASH]
    with sdpa_kernel(SDPBackend.MATH):
        assert choose_cuda_backend(call(), GpuArch.sm90).backend == MATH
    assert choose_cuda_backend(call(), GpuArch.sm90).backend == FLASH  # restored on exit


def test_the_cpus_own_choice():
    assert cpu_backend(call()) == CPU_FLASH
    assert cpu_backend(call(dropout=0.1)) == CPU_MATH  # the CPU's flash kernel takes no dropout
    assert cpu_backend(call(v=(2, 8, 128, 32))) == CPU_MATH
    assert cpu_backend(call(q=(16, 128, 64))) == CPU_MATH


def test_the_facts_of_a_call_on_tensors():
    q = torch.empty(2, 4, 16, 8, dtype=BF16, requires_grad=True)
    packed = torch.empty(2, 16, 3, 4, 8).permute(2, 0, 3, 1, 4)  # a (q, k, v) projection
    c = SdpaCall.of(q, packed[1], packed[2], dropout_p=0.1)
    assert c.q_shape == (2, 4, 16, 8) and c.offsets == (0, 32, 64) and c.last_strides == (1,) * 3
    assert c.requires_grad and c.dropout_p == 0.1 and not c.has_mask
    with torch.no_grad():
        assert not SdpaCall.of(q, q, q).requires_grad
    assert GpuArch.sm90.capability == (9, 0) and GpuArch.sm120.capability == (12, 0)
