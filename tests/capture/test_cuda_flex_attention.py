"""A GPU target's capture of a step training through compiled FlexAttention with a document mask
(actors/capture/fake/cuda_flex_attention.py): the Triton lowering's buffers, nothing of seq x
seq, and the peak of a fused kernel's saved set; refused with the fix on a CPU target and in
eager mode."""
from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from actors.capture.fake.cuda_dispatch import FLEX
from actors.errors import ConfigError
from actors.trace import load_trace
from actors.trace.conventions import trace_file_name
from actors.trace.meta_file import meta_path_of, read_meta
from orchestrator.reports.predict_notes import kernel_lines
from tests.support.fake_vs_real import as_entrypoint
from tests.support.step_peaks import predicted_peak

BATCH, HEADS, SEQ, HEAD_DIM = 2, 4, 256, 64
DOCUMENTS = [0] * 100 + [1] * 156  # two packed sequences


class PackedAttention(nn.Module):
    """A projection to q, k, v (``num_kv_heads`` of k and v), attention, an output projection."""

    def __init__(self, num_kv_heads: int = HEADS):
        super().__init__()
        self.num_kv_heads = num_kv_heads
        kv_width = num_kv_heads * HEAD_DIM
        self.q = nn.Linear(HEADS * HEAD_DIM, HEADS * HEAD_DIM)
        self.kv = nn.Linear(HEADS * HEAD_DIM, 2 * kv_width)
        self.o = nn.Linear(HEADS * HEAD_DIM, HEADS * HEAD_DIM)

    def forward(self, x, attend):
        q = self.q(x).view(BATCH, SEQ, HEADS, HEAD_DIM).transpose(1, 2)
        k, v = self.kv(x).view(BATCH, SEQ, 2, self.num_kv_heads, HEAD_DIM).permute(2, 0, 3, 1, 4)
        return self.o(attend(q, k, v).transpose(1, 2).reshape(BATCH, SEQ, HEADS * HEAD_DIM))


def _flex_build(compiled: bool = True, num_kv_heads: int = HEADS, head_bias: bool = False):
    """The step; ``head_bias``: a learned per-head bias added to the scores (``score_mod``)."""
    def build(ctx):
        torch.manual_seed(0)
        net = PackedAttention(num_kv_heads).to(ctx.device)
        bias = nn.Parameter(torch.zeros(HEADS, device=ctx.device))
        net.register_parameter("head_bias", bias if head_bias else None)
        optimizer = torch.optim.AdamW(net.parameters(), foreach=False)
        documents = torch.tensor(DOCUMENTS, device=ctx.device)

        def document_causal(b, h, q_idx, kv_idx):
            return (documents[q_idx] == documents[kv_idx]) & (q_idx >= kv_idx)

        mask = create_block_mask(document_causal, None, None, SEQ, SEQ, device=ctx.device)
        flex = torch.compile(flex_attention) if compiled else flex_attention

        def biased(score, b, h, q_idx, kv_idx):
            return score + bias[h]

        def attend(q, k, v):
            return flex(q, k, v, score_mod=biased if head_bias else None, block_mask=mask,
                        enable_gqa=num_kv_heads != HEADS)

        return _training(net, optimizer, attend, ctx)
    return build


def _training(net, optimizer, attend, ctx):
    """build()'s answer for ``net`` attending through ``attend``: one training step."""
    def step(batch):
        (x,) = batch
        net(x, attend).sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return net, lambda: (torch.randn(BATCH, SEQ, HEADS * HEAD_DIM, device=ctx.device),), step


def _sdpa_build(ctx):
    """The same step through the CPU's fused attention (flash: q, k, v, the output and a
    float32 logsumexp saved, as FlexAttention's kernels save them)."""
    torch.manual_seed(0)
    net = PackedAttention().to(ctx.device)
    optimizer = torch.optim.AdamW(net.parameters(), foreach=False)

    def attend(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    return _training(net, optimizer, attend, ctx)


def test_compiled_flex_attention_is_captured_as_the_gpus_kernels(tmp_path):
    spec = as_entrypoint(_flex_build(), "flex_document_mask")
    predicted = predicted_peak(spec, tmp_path / "sm90", "sm90")
    trace = load_trace(tmp_path / "sm90" / trace_file_name(0))
    made = Counter((t.shape, t.dtype) for op in trace.ops
                   for t in op.output_tensors() if op.name == "aten::empty_strided")
    rows = (BATCH, HEADS, SEQ)
    # forward: logsumexp and row max; backward: delta (a reduction inductor plans, not made here)
    assert made[(rows, "float32")] >= 2
    assert made[((BATCH, HEADS, SEQ, HEAD_DIM), "float32")] >= 4  # out, grads of q, k, v
    scores = BATCH * HEADS * SEQ * SEQ
    assert max(t.numel for op in trace.ops for t in op.output_tensors()) < scores
    dispatch = read_meta(meta_path_of(tmp_path / "sm90"))["kernel_dispatch"]
    flex = {r["detail"]: r for r in dispatch if r["op"] == FLEX}
    assert set(flex) == {"forward, per compiled graph", "backward, per compiled graph"}
    assert flex["forward, per compiled graph"]["kept_bytes"] == 4 * BATCH * HEADS * SEQ
    (line,) = kernel_lines([flex["forward, per compiled graph"]])
    assert "ran as inductor's Triton FlexAttention kernel on sm90" in line
    assert "torch has no CPU kernel for FlexAttention's backward" in line
    # the kernels: forward reads q, k, v and writes out, logsumexp, row max; backward reads
    # q, k, v, logsumexp, delta and the output's gradient
    kernels = {op.name.split("::")[1]: op for op in trace.ops
               if op.name.startswith("tracefleet_kernel::")}
    assert [t.shape for t in kernels["flex_attention"].input_tensors()] == \
        [(BATCH, HEADS, SEQ, HEAD_DIM)] * 4 + [rows] * 2
    assert [t.shape for t in kernels["flex_attention_backward"].input_tensors()][3:6] == \
        [rows, rows, (BATCH, HEADS, SEQ, HEAD_DIM)]
    # the peak is the backward's, holding what a fused kernel holds: the same step through the
    # CPU's flash kernel is predicted within the two float32 rows (logsumexp's twin max and
    # delta) the Triton kernels add; the eager dense path would hold two score matrices more
    sdpa = predicted_peak(as_entrypoint(_sdpa_build, "sdpa_causal"), tmp_path / "cpu")
    assert 0 <= predicted - sdpa <= 3 * 4 * BATCH * HEADS * SEQ


def test_grouped_query_flex_attention_gets_gradients_of_the_kv_heads_and_the_bias(tmp_path):
    spec = as_entrypoint(_flex_build(num_kv_heads=2, head_bias=True), "flex_gqa")
    predicted_peak(spec, tmp_path / "sm90", "sm90")
    trace = load_trace(tmp_path / "sm90" / trace_file_name(0))
    made = Counter(t.shape for op in trace.ops
                   for t in op.output_tensors() if op.name == "aten::empty_strided")
    assert made[(BATCH, 2, SEQ, HEAD_DIM)] >= 2  # grads of k and v, at the kv heads
    assert made[(BATCH, HEADS, SEQ, HEAD_DIM)] >= 2  # the output, the grad of q
    assert made[(HEADS,)] == 1  # the gradient of the bias score_mod reads


def test_a_cpu_target_is_told_to_predict_it_for_a_gpu(tmp_path):
    spec = as_entrypoint(_flex_build(), "flex_on_cpu")
    with pytest.raises(ConfigError, match="backward torch .* runs on GPUs only.*"
                                          "workload.gpu_kernels"):
        predicted_peak(spec, tmp_path / "cpu")


def test_eager_flex_attention_on_a_gpu_target_is_refused_naming_the_fix(tmp_path):
    spec = as_entrypoint(_flex_build(compiled=False), "flex_eager")
    with pytest.raises(ConfigError, match=r"outside torch.compile.*torch.compile\(flex_attention"
                                          r"\).*test_cuda_flex_attention.py"):
        predicted_peak(spec, tmp_path / "sm90", "sm90")
