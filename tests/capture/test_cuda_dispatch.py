"""A capture for a GPU target runs the GPU's kernels on fake: attention through the fused kernel
torch picks (nothing seq x seq made), dropout through CUDA's fused kernel (a one-byte mask)."""
from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from actors.capture.fake.cuda_dispatch import DROPOUT, SDPA, cuda_kernels
from actors.capture.fake.sdpa_choice import SdpaCall, choose_cuda_backend
from actors.gpu_arch import GpuArch

B, H, L, E = 2, 4, 256, 32


class OpLog(TorchDispatchMode):
    """Every aten op run, and the largest tensor any op made (elements)."""

    def __init__(self):
        super().__init__()
        self.ops, self.largest = Counter(), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops[func.overloadpacket.__name__] += 1
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def _encoder_step(arch, dtype=torch.bfloat16, dropout=0.1):
    """Forward and backward of one nn.TransformerEncoderLayer on fake: (ops, largest, log)."""
    with FakeTensorMode():
        layer = nn.TransformerEncoderLayer(H * E, H, 2 * H * E, dropout=dropout,
                                           batch_first=True, dtype=dtype)
        x = torch.randn(B, L, H * E, dtype=dtype, requires_grad=True)
        with cuda_kernels(arch) as log, OpLog() as ops:
            layer(x).float().sum().backward()
    return ops, log


def test_encoder_layer_with_dropout_runs_flash_and_makes_nothing_seq_by_seq():
    gpu, log = _encoder_step(GpuArch.sm90)
    assert gpu.ops["_scaled_dot_product_flash_attention"] == 1
    assert gpu.ops["_scaled_dot_product_flash_attention_backward"] == 1
    assert gpu.largest < B * H * L * L  # no score matrix anywhere
    # dropout1, the feed-forward's and dropout2: CUDA's fused kernel, no noise tensor drawn
    assert gpu.ops["native_dropout"] == 3 and gpu.ops["bernoulli_"] == 0
    cpu, none = _encoder_step(None)
    assert none is None and cpu.largest >= B * H * L * L  # the CPU's math path: the scores
    assert cpu.ops["_scaled_dot_product_flash_attention"] == 0
    records = {r["op"]: r for r in log.summary()}
    sdpa = records[SDPA]
    assert (sdpa["kernel"], sdpa["cpu_kernel"], sdpa["num_calls"]) == ("flash", "cpu_math", 1)
    assert sdpa["kept_bytes"] == 4 * B * H * L + 16  # float32 logsumexp + philox seed/offset
    assert sdpa["cpu_bytes"] == 4 * B * H * L * L
    drop = records[DROPOUT]
    assert drop["kernel"] == "native_dropout" and drop["num_calls"] == 3
    # one byte per element of the mask where the CPU keeps a bf16 noise tensor
    assert drop["cpu_bytes"] == 2 * drop["kept_bytes"] > 0
    assert F.scaled_dot_product_attention is torch._C._nn.scaled_dot_product_attention  # restored


def test_fp32_runs_the_memory_efficient_kernel():
    ops, log = _encoder_step(GpuArch.sm80, torch.float32, dropout=0.0)
    assert ops.ops["_scaled_dot_product_efficient_attention"] == 1
    assert ops.ops["_scaled_dot_product_efficient_attention_backward"] == 1
    (sdpa,) = [r for r in log.summary() if r["op"] == SDPA]
    assert sdpa["kernel"] == "efficient" and sdpa["cpu_kernel"] == "cpu_flash"
    assert sdpa["kept_bytes"] == 4 * B * H * L + 16 and sdpa["cpu_bytes"] == 0
    assert not [r for r in log.summary() if r["op"] == DROPOUT]  # p = 0: no kernel at all


@pytest.mark.parametrize("head_dim, mask, kernel", [(72, None, "flash"), (64, "bool", "efficient"),
                                                     (60, None, "flash")])
def test_what_torch_does_around_the_kernel(head_dim, mask, kernel):
    """Flash pads head dims to a multiple of 8 and cuts the output back; the efficient kernel
    gets a boolean mask as an additive one (0 or -inf), expanded to (B, H, L, S)."""
    with FakeTensorMode():
        q, k, v = (torch.randn(B, H, L, head_dim, dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        attn_mask = torch.ones(L, L, dtype=torch.bool).tril() if mask else None
        seen = []

        class Args(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                seen.append((func.overloadpacket.__name__, args))
                return func(*args, **(kwargs or {}))

        with cuda_kernels(GpuArch.sm90), Args():
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        out.sum().backward()
    assert out.shape == (B, H, L, head_dim) and q.grad.shape == q.shape
    name, args = next((n, a) for n, a in seen if n.startswith("_scaled_dot_product_"))
    assert name == f"_scaled_dot_product_{kernel}_attention"
    assert args[0].shape[-1] == -(-head_dim // 8) * 8
    if mask:
        assert args[3].dtype == torch.bfloat16 and args[3].shape == (B, H, L, L)


def test_no_arch_changes_nothing_and_a_typo_is_refused():
    with cuda_kernels(None) as log:
        assert log is None and F.dropout.__module__ == "torch.nn.functional"
    with pytest.raises(Exception, match="workload.gpu_kernels='sm91'; expected one of sm80"):
        with cuda_kernels("sm91"):
            pass


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_choice_is_torchs_own_on_this_gpu():
    """On a real GPU, torch's own choice (_fused_sdp_choice) for a grid of calls."""
    major, minor = torch.cuda.get_device_capability()
    arch = next((a for a in GpuArch if a.capability == (major, minor)), None)
    if arch is None:
        pytest.skip(f"sm{major}{minor} is not a GpuArch")
    names = {1: "flash", 2: "efficient", 0: "math"}
    for head_dim in (60, 64, 72, 128, 200, 256, 512):
        for dtype in (torch.bfloat16, torch.float32):
            for dropout in (0.0, 0.1):
                for masked in (False, True):
                    q = torch.randn(2, 4, 128, head_dim, device="cuda", dtype=dtype,
                                    requires_grad=True)
                    mask = torch.ones(128, 128, device="cuda", dtype=torch.bool) if masked \
                        else None
                    torch_choice = torch._fused_sdp_choice(q, q, q, mask, dropout, False)
                    ours = choose_cuda_backend(SdpaCall.of(q, q, q, mask, dropout), arch)
                    if torch_choice == 3:  # cuDNN first (a CUDA 13 build): flash's bytes
                        assert ours.backend == "flash"
                        continue
                    assert ours.backend == names[torch_choice], (head_dim, dtype, dropout,
                                                                 masked, ours.passed_over)


@pytest.mark.parametrize("dtype, kernel", [(torch.bfloat16, "flash"), (torch.float32,
                                                                        "efficient")])
def test_grouped_query_heads_train(dtype, kernel):
    """enable_gqa: flash takes 8 query heads over 2 key/value heads as they are; the
    memory-efficient kernel gets them repeated (its backward's gradients have the query's
    heads); either way the gradients have the inputs' shapes (transformers' Llama did this)."""
    with FakeTensorMode():
        q = torch.randn(B, 8, L, E, dtype=dtype, requires_grad=True)
        k, v = (torch.randn(B, 2, L, E, dtype=dtype, requires_grad=True) for _ in range(2))
        with cuda_kernels(GpuArch.sm90) as log, OpLog() as ops:
            F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).sum() \
                .backward()
    assert (k.grad.shape, v.grad.shape) == (k.shape, v.shape)
    assert ops.ops[f"_scaled_dot_product_{kernel}_attention_backward"] == 1
    assert [r["kernel"] for r in log.summary()] == [kernel]
