"""A GPU target's fused-attention backward holds what CUDA's kernel allocates beside its
gradients (actors/capture/fake/attention_backward.py): flash's softmax_d and float32 dq_accum,
the expanded key/value gradients under grouped-query attention, the memory-efficient kernel's
delta, and a contiguous copy of the output's gradient only where the kernel's layout needs
one."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from actors.capture.fake.cuda_dispatch import cuda_kernels
from actors.gpu_arch import GpuArch

B, H, KV_HEADS, L, E = 2, 8, 2, 200, 64
BF16, FP32 = torch.bfloat16, torch.float32


class Made(TorchDispatchMode):
    """(op, shape, dtype) of every tensor an op makes in backward."""

    def __init__(self):
        super().__init__()
        self.made = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.made.append((func.overloadpacket.__name__, tuple(t.shape), t.dtype))
        return out


def _backward_made(arch, grad_layout: str, kv_heads: int = KV_HEADS, dtype=BF16,
                   masked: bool = False):
    """What the backward of one SDPA call makes; the output's gradient arrives in
    ``grad_layout``: "bshe" (through a transpose back to tokens, as a block does) or "bhse".
    float32, or a mask, takes the memory-efficient kernel."""
    with FakeTensorMode():
        q = torch.randn(B, H, L, E, dtype=dtype, requires_grad=True)
        k, v = (torch.randn(B, kv_heads, L, E, dtype=dtype, requires_grad=True)
                for _ in range(2))
        mask = torch.ones(L, L, dtype=torch.bool).tril() if masked else None
        with cuda_kernels(arch):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=not masked,
                                                 enable_gqa=kv_heads != H)
            if grad_layout == "bshe":
                out = out.transpose(1, 2).reshape(B, L, H * E)
            with Made() as made:
                out.backward(torch.ones_like(out))
    return made.made


def test_the_workspace_of_cudas_kernel_is_made_for_a_gpu_target():
    made = _backward_made(GpuArch.sm90, "bshe")
    rows = 256  # L rounded up to 128
    assert ("empty", (B, H, rows), FP32) in made  # softmax_d
    assert ("empty", (B, rows, H, E), FP32) in made  # dq_accum: E is already a multiple of 32
    expanded = [m for m in made if m == ("new_empty", (B, L, H, E), BF16)]
    assert len(expanded) == 2  # dk, dv at the query's heads, summed to the kv heads after
    # the gradient arrives as (B, L, H, E) memory: the kernel's layout, so no copy
    assert not [m for m in made if m[0] in ("clone", "contiguous", "_to_copy")]


def test_a_gradient_in_heads_first_layout_is_copied_and_equal_heads_expand_nothing():
    made = _backward_made(GpuArch.sm90, "bhse", kv_heads=H)
    copies = [m for m in made if m[0] == "clone"]
    assert copies == [("clone", (B, L, H, E), BF16)]  # the kernel reads (B, L, H, E)
    assert not [m for m in made if m[0] == "new_empty"]  # no expanded gradients


def test_the_memory_efficient_kernels_delta():
    """float32: delta computed before the kernel from the output-sized float32 product, then
    made (B, H, L) contiguous; bf16 with a mask: the kernel computes it into a float32 row."""
    made = _backward_made(GpuArch.sm90, "bshe", kv_heads=H, dtype=FP32)
    assert ("mul", (B, L, H, E), FP32) in made and ("sum", (B, L, H), FP32) in made
    assert ("clone", (B, H, L), FP32) in made
    assert not [m for m in made if m[0] == "clone" and len(m[1]) == 4]  # no gradient copy
    masked = _backward_made(GpuArch.sm90, "bshe", kv_heads=H, masked=True)
    assert ("empty", (B, H, L), FP32) in masked
    assert not [m for m in masked if m[0] == "mul" and m[1] == (B, L, H, E)]


def test_without_a_gpu_target_the_backward_makes_only_its_gradients():
    """The built-in models' fake capture for a CPU target (replayed with the CPU's kernel)."""
    from actors.capture.fake.cuda_attention import FlashAttention

    with FakeTensorMode():
        q, k, v = (torch.randn(B, H, L, E, dtype=BF16, requires_grad=True) for _ in range(3))
        out = FlashAttention.apply(q, k, v, 0.0, True, None)
        with Made() as made:
            out.transpose(1, 2).sum().backward()
    assert not [m for m in made.made if m[2] == FP32]
