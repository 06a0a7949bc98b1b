"""A capture for a GPU target runs a step's ``torch.autocast("cuda")`` on fake with CUDA's cast
policy (actors/capture/fake/cuda_autocast.py): where CUDA is absent torch disables the region,
and the cpu's own autocast casts other ops than CUDA's."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from actors.capture.fake.cuda_autocast import CUDA_POLICY, autocast_as_on_cuda

BF16, FP32 = torch.bfloat16, torch.float32


def test_the_policy_table_names_exactly_the_ops_torch_casts_on_cuda():
    """Every op this torch registers a CUDA autocast kernel for is in one policy of the table,
    once; a torch that adds or drops one fails here."""
    registered = {name[len("aten::"):] for name in torch._C._dispatch_get_all_op_names()
                  if name.startswith("aten::") and
                  torch._C._dispatch_has_kernel_for_dispatch_key(name, "AutocastCUDA")}
    listed = [name for names in CUDA_POLICY.values() for name in names]
    assert len(listed) == len(set(listed))
    assert set(listed) == registered


class Dtypes(TorchDispatchMode):
    """The output dtype of each aten op run (its last call)."""

    def __init__(self):
        super().__init__()
        self.out, self.made = {}, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        first = out[0] if isinstance(out, (tuple, list)) and out else out
        if isinstance(first, torch.Tensor):
            self.out[name] = first.dtype
            self.made.append((name, first.dtype, first.numel()))
        return out


def _forward(device_type="cuda", as_on_cuda=True):
    """A block's forward under ``torch.autocast(device_type, bf16)`` on fake: the ops'
    output dtypes."""
    with FakeTensorMode():
        norm, proj = nn.LayerNorm(64), nn.Linear(64, 128)
        x, target = torch.randn(8, 64), torch.randint(0, 128, (8,))
        w = torch.randn(64, requires_grad=True)
        with (autocast_as_on_cuda() if as_on_cuda else warnings.catch_warnings()), \
                Dtypes() as dtypes, torch.autocast(device_type, dtype=BF16):
            logits = proj(norm(x))
            dtypes.out["rms_norm"] = F.rms_norm(logits, (128,)).dtype
            torch.softmax(logits, -1)
            logits.exp()
            logits.sum()
            F.cross_entropy(logits, target)
            torch.einsum("i,i->", w, w)
    return dtypes


def test_a_cuda_region_casts_as_cuda_does_on_fake():
    cuda, cpu = _forward(), _forward("cpu", as_on_cuda=False)
    assert cuda.out["addmm"] == BF16  # the linear: lower precision on both
    # rms_norm, softmax, exp, sum of the bf16 logits: float32 on CUDA, the input's dtype on
    # the cpu
    for name in ("rms_norm", "_softmax", "exp", "sum"):
        assert (cuda.out[name], cpu.out[name]) == (FP32, BF16), name


def test_cross_entropy_takes_cudas_path():
    """CUDA's cross_entropy (not on its autocast list) runs log_softmax in the logits' dtype
    (bf16, saved for backward) and nll_loss's float32 cast of it; the cpu's autocast casts the
    whole logits to float32 before log_softmax."""
    logits = 8 * 128
    cuda = [m for m in _forward().made if m[2] == logits]
    at = cuda.index(("_log_softmax", BF16, logits))
    assert cuda[at + 1:at + 3] == [("detach", BF16, logits), ("_to_copy", FP32, logits)]
    cpu = [m for m in _forward("cpu", as_on_cuda=False).made if m[2] == logits]
    assert ("_log_softmax", FP32, logits) in cpu and ("_log_softmax", BF16, logits) not in cpu


def test_without_it_a_cuda_region_is_disabled_on_fake_and_the_tables_come_back():
    with pytest.warns(UserWarning, match="Disabling autocast"):
        dtypes = _forward(as_on_cuda=False).out
    assert dtypes["addmm"] == FP32
    assert torch.amp.autocast_mode.autocast.__init__.__qualname__ == "autocast.__init__"
    with torch.autocast("cpu", dtype=BF16):  # the cpu's own policy again
        assert torch.randn(2, 4, dtype=BF16).exp().dtype == BF16


def test_a_weight_is_cast_once_per_region():
    """A float32 parameter used by two einsums (a CUDA-only lower precision op) is copied to
    bf16 once, as torch's autocast cache does; the next region copies it again."""
    with FakeTensorMode():
        w = nn.Parameter(torch.randn(64, 64))
        x = torch.randn(8, 64)
        with autocast_as_on_cuda(), Dtypes() as dtypes:
            for _ in range(2):
                with torch.autocast("cuda", dtype=BF16):
                    torch.einsum("bi,ij->bj", x, w)
                    torch.einsum("bi,ij->bj", x, w)
    casts = [m for m in dtypes.made if m[0] == "_to_copy" and m[2] == 64 * 64]
    assert len(casts) == 2


def test_a_gpu_targets_capture_logs_each_region_and_the_prediction_names_it():
    from actors.capture.fake.cuda_dispatch import AUTOCAST, cuda_kernels
    from actors.gpu_arch import GpuArch
    from orchestrator.reports.predict_notes import kernel_lines

    with FakeTensorMode():
        proj = nn.Linear(64, 64)
        with cuda_kernels(GpuArch.sm90) as log:
            for _ in range(2):
                with torch.autocast("cuda", dtype=BF16):
                    assert proj(torch.randn(8, 64)).dtype == BF16
    (record,) = [r for r in log.summary() if r["op"] == AUTOCAST]
    assert (record["num_calls"], record["cpu_kernel"]) == (2, "disabled (no CUDA)")
    (line,) = kernel_lines([record])
    assert line == ("kernels: 2 x torch.autocast region (device_type cuda, bfloat16) ran as CUDA's "
                    "autocast policy on sm90; the CPU would have run no autocast at all (torch "
                    "disables a cuda region where CUDA is absent)")


DIM, SEQ, BATCH, VOCAB = 256, 128, 4, 4096


def _attention_lm():
    torch.manual_seed(0)
    model = nn.ModuleDict({"norm": nn.LayerNorm(DIM), "qkv": nn.Linear(DIM, 3 * DIM),
                           "head": nn.Linear(DIM, VOCAB)})
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)


def _amp_step(model, optimizer, x, target):
    """A GPU step's mixed precision as written for CUDA: torch.autocast("cuda", bf16)."""
    with torch.autocast("cuda", dtype=BF16):
        q, k, v = model["qkv"](model["norm"](x)).chunk(3, dim=-1)
        probs = torch.softmax(q @ k.transpose(-1, -2) / DIM ** 0.5, dim=-1)
        logits = model["head"](probs @ v)
        loss = F.cross_entropy(logits.flatten(0, 1), target.flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def _batch():
    return torch.randn(BATCH, SEQ, DIM), torch.randint(0, VOCAB, (BATCH, SEQ))


def build_amp_step(ctx):
    model, optimizer = _attention_lm()
    return model, _batch, lambda batch: _amp_step(model, optimizer, *batch)


def test_the_cuda_policy_step_is_predicted_as_it_runs(tmp_path):
    """The step run for real on the cpu under CUDA's policy (the same kernels, on real
    tensors), measured by the CPU allocator's counter, against its sm90 capture's faithful dry
    run; the cpu target's capture (the region disabled: float32 throughout) predicts more."""
    from tests.support.fake_vs_real import as_entrypoint
    from tests.support.step_peaks import measured_peak, predicted_peak

    def real_step():
        model, optimizer = _attention_lm()
        batch = _batch()
        return lambda: _amp_step(model, optimizer, *batch)

    with autocast_as_on_cuda():
        measured = measured_peak(real_step)
    spec = as_entrypoint(build_amp_step, "amp_step")
    gpu = predicted_peak(spec, tmp_path / "sm90", "sm90")
    with pytest.warns(UserWarning, match="Disabling autocast"):
        fp32 = predicted_peak(spec, tmp_path / "cpu")
    print({"predicted": gpu, "measured": measured, "ratio": round(gpu / measured, 4),
           "cpu_target_fp32": fp32})
    assert 0.98 <= gpu / measured <= 1.02, (gpu, measured)
    assert fp32 > 1.1 * gpu


def test_a_library_asking_about_cudas_region_hears_about_it():
    """torch.amp.custom_fwd(device_type="cuda") (bitsandbytes', flash-attn's wrappers) reads
    cuda's region: inside one it casts to the region's dtype and runs without autocast, as on
    a GPU; a cuda region left without a dtype is float16, CUDA's default."""
    class Scaled(torch.autograd.Function):
        @staticmethod
        @torch.amp.custom_fwd(device_type="cuda", cast_inputs=torch.float16)
        def forward(ctx, x):
            ctx.enabled = torch.is_autocast_enabled("cuda")
            return x * 2

        @staticmethod
        @torch.amp.custom_bwd(device_type="cuda")
        def backward(ctx, grad):
            return grad * 2

    with FakeTensorMode():
        x = torch.randn(4, 8, requires_grad=True)
        with autocast_as_on_cuda():
            with torch.autocast("cuda"):
                assert torch.is_autocast_enabled() and torch.get_autocast_dtype("cuda") == \
                    torch.float16
                assert torch.mm(x, x.t()).dtype == torch.float16
                assert Scaled.apply(x).dtype == torch.float16
            assert not torch.is_autocast_enabled("cuda")
    assert torch.is_autocast_enabled is torch._C.is_autocast_enabled


def test_norm_without_a_dtype_gets_float32_as_on_cuda():
    """fp32_append_dtype: the norm overloads without a dtype run as the ones with, float32 (the
    arguments the caller left out at their defaults)."""
    x = torch.randn(4, 4, dtype=BF16)
    with autocast_as_on_cuda(), torch.autocast("cuda", dtype=BF16):
        whole, rows = torch.ops.aten.norm.Scalar(x), torch.ops.aten.norm.ScalarOpt_dim(x, 2, [1])
    assert (whole.dtype, rows.dtype, rows.shape) == (FP32, FP32, (4,))
    torch.testing.assert_close(whole, x.float().norm(), rtol=1e-2, atol=1e-2)


def test_attention_in_a_region_runs_on_the_regions_dtype():
    """SDPA is on autocast's lower-precision list: q, k, v of float32 (a bf16 projection
    rotated by float32 tables, as transformers' Llama does) are cast to bf16 and CUDA's flash
    kernel runs, not the memory-efficient one float32 would pick."""
    from actors.capture.fake.cuda_dispatch import SDPA, cuda_kernels
    from actors.gpu_arch import GpuArch

    with FakeTensorMode():
        q, k, v = (torch.randn(2, 4, 128, 64, requires_grad=True) for _ in range(3))
        with cuda_kernels(GpuArch.sm90) as log, torch.autocast("cuda", dtype=BF16):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.float().sum().backward()
    assert out.dtype == BF16 and q.grad.dtype == FP32
    (record,) = [r for r in log.summary() if r["op"] == SDPA]
    assert (record["kernel"], record["detail"]) == ("flash", "bfloat16, dropout 0")


def test_a_compiled_frame_in_a_cuda_region_leaves_cudas_own_state_as_it_was():
    """Dynamo saves cuda's autocast state around a frame it compiles and sets it back after;
    read through the block's answers (the cpu's region), it must be written there too, or the
    cpu's bfloat16 and enabled flag become cuda's beyond the block."""
    before = torch.get_autocast_dtype("cuda"), torch.is_autocast_enabled("cuda")
    with FakeTensorMode():
        x = torch.randn(4, 8)
        with autocast_as_on_cuda(), torch.autocast("cuda", dtype=BF16):
            assert torch.compile(lambda t: t @ t.t(), backend="eager")(x).dtype == BF16
            assert torch.get_autocast_dtype("cuda") == BF16
    assert (torch.get_autocast_dtype("cuda"), torch.is_autocast_enabled("cuda")) == before
    assert torch.set_autocast_dtype is torch._C.set_autocast_dtype
