"""Llama 4 (actors/capture/workloads/models/llama4/): MoE blocks interleaved with dense ones,
chunked attention in the rotary blocks and NoPE blocks attending globally, expert tensor
parallel on fake, the presets' parameter counts, and what it cannot run refused."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from actors.capture.workloads.attention import Attention
from actors.capture.workloads.build import build_model
from actors.capture.workloads.config import WorkloadConfig, validate
from actors.capture.workloads.mesh import ParallelismConfig, validate_parallelism
from actors.capture.workloads.models.llama.model import apply_rotary, repeat_kv, rotary_tables
from actors.capture.workloads.models.llama4.model import ChunkedAttention
from actors.errors import ConfigError
from actors.trace import load_trace
from actors.trace.conventions import trace_file_name
from orchestrator.config import compose
from orchestrator.run.capture import CaptureConfig, run_capture_job

SMALL_LLAMA4 = dict(model="llama4", vocab=64, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2,
                    ffn_dim=128, moe_experts=4, moe_top_k=1, moe_ffn_dim=64,
                    moe_shared_experts=1, moe_every=2, moe_score="sigmoid", attention_chunk=16,
                    nope_every=4, seq_len=32, batch_size=2)


def test_blocks_interleave_moe_and_the_fourth_has_no_rotary_embedding():
    torch.manual_seed(0)
    model, _ = build_model(WorkloadConfig(**SMALL_LLAMA4))
    assert [type(b.feed_forward).__name__ for b in model.layers] == \
        ["SwiGLU", "MoE", "SwiGLU", "MoE"]
    assert [b.attention.use_rope for b in model.layers] == [True, True, True, False]
    idx = torch.randint(0, 64, (2, 32))
    loss = model(idx, idx.roll(1, dims=1))
    loss.backward()
    assert torch.isfinite(loss) and model.layers[1].feed_forward.experts.w1.grad is not None


def _reference(attn: ChunkedAttention, x, cos, sin, allowed):
    """Attention at absolute positions under the boolean mask ``allowed`` (query, key)."""
    b, t, _ = x.shape
    q, k, v = (z.transpose(1, 2) for z in attn.project(x))
    if attn.use_rope:
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    k, v = repeat_kv(k, 2), repeat_kv(v, 2)
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
    return attn.wo(y.transpose(1, 2).reshape(b, t, -1))


def test_chunked_attention_is_block_causal_and_a_nope_block_global():
    """Rotary per chunk (positions from each chunk's start) gives the scores of absolute
    positions (rotary scores depend on the distance only): the reference model's chunked
    mask. A NoPE block attends to every earlier token, without rotary."""
    torch.manual_seed(0)
    attn = ChunkedAttention(32, 4, 2, 8, Attention.fused, 1e-5)
    attn.chunk = 4
    x = torch.randn(2, 12, 32)
    cos, sin = rotary_tables(8, 12, 10000.0, "cpu")
    pos = torch.arange(12)
    causal = pos[:, None] >= pos[None, :]
    chunked = causal & (pos[:, None] // 4 == pos[None, :] // 4)
    with torch.no_grad():
        assert torch.allclose(attn(x, cos, sin), _reference(attn, x, cos, sin, chunked),
                              atol=1e-5)
        assert not torch.allclose(attn(x, cos, sin), _reference(attn, x, cos, sin, causal),
                                  atol=1e-3)
        attn.use_rope = False
        assert torch.allclose(attn(x, cos, sin), _reference(attn, x, cos, sin, causal),
                              atol=1e-5)


def test_expert_tensor_parallel_on_fake(tmp_path):
    """tp 2 over 4 ranks: every rank routes the whole sequence and runs half of each expert's
    hidden units (and of the shared expert's); the rotary blocks' attention runs per chunk."""
    cfg = CaptureConfig(workload=WorkloadConfig(**SMALL_LLAMA4, parallel="fsdp2",
                                                precision="bf16_mixed", device="fake",
                                                parallelism=ParallelismConfig(tp=2)),
                        world_size=4, out_dir=str(tmp_path))
    meta = run_capture_job(cfg, rank0_only=True).meta
    assert meta["mesh"]["description"] == "dp_shard 2 x tp 2"
    trace = load_trace(tmp_path / trace_file_name(0))
    grouped = [op for op in trace.ops if op.name == "aten::_grouped_mm"]
    assert len(grouped) == 2 * 9  # two MoE blocks: 3 grouped matmuls forward, 6 backward
    # tokens (batch 2 x seq 32, all of them) x experts' w1 (4 experts, 64 wide, 64 / tp units)
    assert [a.shape for a in grouped[0].inputs[:2]] == [(64, 64), (4, 64, 32)]
    attention = [op.inputs[0].shape for op in trace.ops
                 if op.name == "aten::_scaled_dot_product_flash_attention"]
    # (batch x chunks, heads / tp, tokens, head size): 3 chunked blocks, then the NoPE one
    assert attention == [(4, 2, 16, 16)] * 3 + [(2, 2, 32, 16)]


def _parameters(preset: str) -> int:
    cfg = compose(None, [f"+workload={preset}"]).workload
    with torch.device("meta"):
        model, _ = build_model(WorkloadConfig(**{k: cfg[k] for k in (
            "model", "vocab", "d_model", "n_layers", "n_heads", "n_kv_heads", "ffn_dim",
            "moe_experts", "moe_top_k", "moe_ffn_dim", "moe_shared_experts", "moe_every",
            "moe_score", "attention_chunk", "nope_every")}))
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("preset, experts, moe_every, card", [
    ("llama4_scout", 16, 1, 109e9), ("llama4_maverick", 128, 2, 400e9)])
def test_presets_have_the_model_cards_parameters(preset, experts, moe_every, card):
    """The text model: 48 blocks of 40 x 128 query and 8 x 128 key/value heads on 5120, MoE
    blocks of 8192-wide experts + a shared one (top-1), dense ones 16384 wide; the model
    cards count Scout's vision encoder too (109B)."""
    d, hidden, dense, vocab, n = 5120, 8192, 16384, 202048, 48
    attention = 2 * d * 40 * 128 + 2 * d * 8 * 128 + 2 * d
    moe = (experts + 1) * 3 * d * hidden + d * experts
    num_moe = n // moe_every
    expected = 2 * vocab * d + d + n * attention + num_moe * moe + (n - num_moe) * 3 * d * dense
    assert _parameters(preset) == expected
    assert 0.98 < expected / card < 1.01


@pytest.mark.parametrize("fields, message", [
    ({"attention_chunk": 12}, "does not split workload.seq_len=32"),
    ({"model": "llama", "moe_every": 1}, "chunked attention and NoPE blocks are "
                                         "workload.model=llama4's"),
    ({"moe_every": 0}, "moe_every=0: must be >= 1"),
])
def test_what_llama4_cannot_be_is_refused(fields, message):
    with pytest.raises(ConfigError, match=message):
        validate(WorkloadConfig(**{**SMALL_LLAMA4, **fields}))


@pytest.mark.parametrize("fields, message", [
    ({"parallelism": {"tp": 2, "ep": 2, "pp": 2}}, "under pipeline parallel"),
    ({"parallelism": {"tp": 2}, "moe_ffn_dim": 63}, r"hidden size 63 \(workload.moe_ffn_dim\) "
                                                    "is not divisible by tp=2"),
])
def test_expert_splits_not_built_are_refused(fields, message):
    cfg = WorkloadConfig(**{**SMALL_LLAMA4, **fields}, parallel="fsdp2", precision="bf16_mixed",
                         device="fake")
    with pytest.raises(ConfigError, match=message):
        validate_parallelism(cfg, 8)
