"""The model registry (actors/capture/workloads/models/): every family named in ``workload.model``
is registered, every workload field reaches the capture cache key, and the Qwen3 family is built
as its model card describes it."""
from __future__ import annotations

import dataclasses
from enum import Enum

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from actors.capture.workloads.mesh import ParallelismConfig, validate_parallelism
from actors.capture.workloads.models.registry import MODEL_SPECS, model_spec
from actors.capture.workloads.models.llama.model import chunked_cross_entropy
from actors.capture.workloads.moe import MoE, MoeRouter, MoeScore, MoeSpec
from actors.capture.workloads.config import ModelName, WorkloadConfig, validate
from actors.capture.workloads.build import build_model
from actors.errors import ConfigError
from actors.trace import load_trace
from actors.trace.conventions import trace_file_name
from orchestrator.config import compose
from orchestrator.run.capture import CaptureConfig, run_capture_job
from orchestrator.studies.study_traces import capture_key

# Not in the key, on purpose: the ZeRO-3 emulation is a replay setting; kind and dtype are
# deprecated aliases cleared when the config is built (they set model, parallel, precision).
NOT_CAPTURE_KNOBS = {"zero3_emulation", "kind", "dtype"}

QWEN3_32B = dict(model="qwen3", vocab=151936, d_model=5120, n_layers=64, n_heads=64,
                 n_kv_heads=8, head_dim=128, ffn_dim=25600, seq_len=128)


def test_every_model_name_but_custom_is_a_registered_family():
    assert set(MODEL_SPECS) == {m.value for m in ModelName} - {"custom"}
    for name, spec in MODEL_SPECS.items():
        assert spec.name == name and model_spec(ModelName(name)) is spec


def _changed(value):
    """A value of the same kind as ``value`` that differs from it."""
    if isinstance(value, Enum):
        return next(m for m in type(value) if m != value)
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1
    if isinstance(value, str):
        return value + "x"
    if isinstance(value, ParallelismConfig):
        return dataclasses.replace(value, tp=2)
    raise AssertionError(f"no changed value for {value!r}")


def test_every_workload_field_reaches_the_cache_key():
    """A field a new knob adds cannot be forgotten in the key: a job that changes it would
    reuse another job's capture."""
    base = WorkloadConfig(model="llama", gpu_kernels="sm90", float8_all_gather=False)
    key = capture_key(base, 8)
    fields = [f.name for f in dataclasses.fields(WorkloadConfig)
              if f.name not in NOT_CAPTURE_KNOBS]
    assert len(fields) > 40
    for name in fields:
        job = dataclasses.replace(base)
        object.__setattr__(job, name, _changed(getattr(base, name)))
        assert capture_key(job, 8) != key, f"workload.{name} is not in the capture cache key"
    replayed_as_zero3 = dataclasses.replace(base)  # the same capture, another replay
    replayed_as_zero3.zero3_emulation = dataclasses.replace(base.zero3_emulation,
                                                            strategy="per_module")
    assert capture_key(replayed_as_zero3, 8) == key


def test_knobs_left_unset_keep_the_keys_of_earlier_captures():
    """Fields added since caches were first keyed (head_dim, tie_embeddings, loss_chunks,
    reshard_after_forward, gpu_kernels, compile) stay out of the key at their defaults: the
    default workload's key is the one every earlier version computed."""
    assert capture_key(WorkloadConfig(), 8, True) == "d88dfa4dd2"
    assert capture_key(WorkloadConfig(loss_chunks=2), 8, True) != "d88dfa4dd2"


def _param_count(cfg: WorkloadConfig) -> int:
    with torch.device("meta"):
        model, _ = build_model(cfg)
    return sum(p.numel() for p in model.parameters())


def test_qwen3_32b_has_its_model_cards_parameters():
    """64 heads x 128 = 8192 wide on a 5120 model, q/k norms of 128 per layer: 32.8B."""
    d, h, kv, hd, f, v, n = 5120, 64, 8, 128, 25600, 151936, 64
    per_layer = d * h * hd + 2 * d * kv * hd + h * hd * d + 2 * hd + 2 * d + 3 * d * f
    expected = 2 * v * d + n * per_layer + d
    assert _param_count(WorkloadConfig(**QWEN3_32B)) == expected
    assert abs(expected / 32.8e9 - 1) < 0.005
    # the same shapes as a llama: no q/k norms, and a head size forced to 5120 / 64 = 80
    llama = _param_count(WorkloadConfig(**{**QWEN3_32B, "model": "llama", "head_dim": 0}))
    assert llama == expected - n * (2 * hd + 2 * d * (h + kv) * (hd - 80))


def test_tied_embeddings_are_one_parameter():
    cfg = WorkloadConfig(model="qwen3", vocab=1024, d_model=64, n_heads=4, head_dim=32)
    untied = _param_count(cfg)
    with torch.device("meta"):
        model, _ = build_model(dataclasses.replace(cfg, tie_embeddings=True))
    assert model.output.weight is model.tok_embeddings.weight
    assert sum(p.numel() for p in model.parameters()) == untied - 1024 * 64


def test_qwen3_moe_renormalizes_the_chosen_experts_scores():
    cfg = WorkloadConfig(model="qwen3", moe_experts=4, moe_top_k=2, d_model=32, n_heads=2)
    with torch.device("meta"):
        model, _ = build_model(cfg)
    assert model.layers[0].feed_forward.spec.normalize_top_k
    assert not build_model(dataclasses.replace(cfg, model="llama"))[0].layers[0] \
        .feed_forward.spec.normalize_top_k


def test_chunked_loss_is_the_whole_loss_value_and_gradient():
    torch.manual_seed(0)
    output = torch.nn.Linear(16, 300, bias=False)
    h = torch.randn(2, 12, 16, requires_grad=True)
    targets = torch.randint(0, 300, (2, 12))
    whole = torch.nn.functional.cross_entropy(output(h).float().view(-1, 300),
                                              targets.view(-1))
    grads = torch.autograd.grad(whole, (h, output.weight))
    chunked = chunked_cross_entropy(output, h, targets, 5)  # 24 tokens: 5, 5, 5, 5, 4
    torch.testing.assert_close(chunked, whole)
    for got, want in zip(torch.autograd.grad(chunked, (h, output.weight)), grads):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("fields, message", [
    (dict(model="gpt", head_dim=32), "workload.head_dim=32 is a knob of the Llama-style"),
    (dict(model="gpt", loss_chunks=4), "workload.loss_chunks=4 is a knob of the Llama-style"),
    (dict(model="llama", loss_chunks=0), "workload.loss_chunks=0: must be >= 1"),
    (dict(model="qwen3", d_model=100, n_heads=8), "not divisible by workload.n_heads=8 "
                                                  r"\(or set workload.head_dim\)"),
    (dict(model="qwen3", head_dim=31), "rotary embeddings need an even head size"),
    (dict(model="gpt", moe_experts=4), "workload.model=gpt has no MoE block"),
])
def test_family_knobs_are_checked(fields, message):
    with pytest.raises(ConfigError, match=message):
        validate(WorkloadConfig(**fields))


@pytest.mark.parametrize("knob", [dict(tie_embeddings=True), dict(loss_chunks=4)])
@pytest.mark.parametrize("split", [dict(tp=2), dict(pp=2)])
def test_knobs_the_tp_and_pp_plans_cannot_keep_are_refused(knob, split):
    cfg = WorkloadConfig(model="qwen3", parallel="fsdp2", device="fake", n_layers=4,
                         parallelism=ParallelismConfig(**split), **knob)
    name = next(iter(knob))
    with pytest.raises(ConfigError, match=f"workload.{name}=.* with (tp|pp)=2"):
        validate_parallelism(cfg, 4)


DEEPSEEK_V3_671B = dict(model="deepseek_v3", vocab=129280, d_model=7168, n_layers=61,
                        n_heads=128, head_dim=128, mla_kv_lora_rank=512, mla_q_lora_rank=1536,
                        mla_rope_head_dim=64, mla_v_head_dim=128, ffn_dim=18432,
                        moe_experts=256, moe_top_k=8, moe_ffn_dim=2048, moe_shared_experts=1,
                        moe_dense_layers=3, moe_score="sigmoid", moe_groups=8,
                        moe_limited_groups=4, seq_len=128)
SMALL_DEEPSEEK = dict(model="deepseek_v3", vocab=64, d_model=64, n_layers=3, n_heads=4,
                      head_dim=32, mla_kv_lora_rank=32, mla_q_lora_rank=48, mla_rope_head_dim=16,
                      mla_v_head_dim=24, ffn_dim=128, moe_experts=8, moe_top_k=2, moe_ffn_dim=32,
                      moe_shared_experts=1, moe_dense_layers=1, moe_score="sigmoid",
                      moe_groups=4, moe_limited_groups=2, seq_len=16, batch_size=2)


def test_deepseek_v3_has_its_671b_parameters():
    """MLA's low-rank projections, 3 dense blocks, 58 of 256 routed + 1 shared experts; the
    multi-token-prediction module (the model card's other 14B) is not built."""
    assert abs(_param_count(WorkloadConfig(**DEEPSEEK_V3_671B)) / 671e9 - 1) < 0.001
    # conf/workload/deepseek_v3_671b.yaml trains these shapes (torchtitan's 671B flavor)
    preset = compose(None, ["+workload=deepseek_v3_671b"]).workload
    assert {k: preset[k] for k in DEEPSEEK_V3_671B if k != "seq_len"} == \
        {k: v for k, v in DEEPSEEK_V3_671B.items() if k != "seq_len"}


def test_deepseek_v3_blocks_latent_attention_and_dense_first_layers():
    torch.manual_seed(0)
    model, _ = build_model(WorkloadConfig(**SMALL_DEEPSEEK))
    kinds = [type(block.feed_forward).__name__ for block in model.layers]
    assert kinds == ["SwiGLU", "MoE", "MoE"]
    attention = model.layers[0].attention
    assert attention.wkv_a.out_features == 32 + 16  # the latent and the shared rotated key
    assert attention.wkv_b.out_features == 4 * (32 + 24)  # per head: key part and value
    assert attention.wq_b.out_features == 4 * (32 + 16)
    idx = torch.randint(0, 64, (2, 16))
    loss = model(idx, idx.roll(1, dims=1))
    loss.backward()  # values narrower than queries: CPU's flash kernel on padded values
    assert torch.isfinite(loss) and attention.wkv_b.weight.grad is not None


def test_node_limited_routing_chooses_within_the_best_groups():
    torch.manual_seed(0)
    moe = MoE(16, MoeSpec(8, 2, 32, 0, MoeRouter.topk, 0.0, False, MoeScore.sigmoid, 4, 1))
    scores = torch.sigmoid(moe.gate(torch.randn(64, 16)))
    kept = moe._group_limited(scores)
    groups_used = (kept.view(64, 4, 2) > 0).any(-1).sum(-1)
    assert groups_used.eq(1).all()  # one group of two experts per token
    best = scores.view(64, 4, 2).topk(2, dim=-1).values.sum(-1).argmax(-1)
    assert torch.equal((kept.view(64, 4, 2) > 0).any(-1).float().argmax(-1), best)


@pytest.mark.parametrize("ac", ["none", "selective_op"])
def test_deepseek_v3_captures_on_fake_with_expert_parallel(tmp_path, ac):
    """ep 2 over 4 ranks with a dense first block: only the MoE blocks' experts are split
    and get FSDP units of their own; under selective AC (DeepSeek-V3 671B's torchtitan
    config) the experts' units are all-gathered inside the checkpointed blocks."""
    cfg = CaptureConfig(workload=WorkloadConfig(**SMALL_DEEPSEEK, parallel="fsdp2",
                                                precision="bf16_mixed", device="fake",
                                                activation_checkpointing=ac,
                                                parallelism=ParallelismConfig(ep=2)),
                        world_size=4, out_dir=str(tmp_path))
    meta = run_capture_job(cfg, rank0_only=True).meta
    assert meta["mesh"]["description"] == "dp_shard 4 x ep 2"
    trace = load_trace(tmp_path / trace_file_name(0))
    names = {op.name for op in trace.ops}
    # the memory-efficient kernel, as CUDA's SDPA runs MLA's 48-wide q/k and 24-wide v
    assert "aten::_efficient_attention_forward" in names \
        or "aten::_scaled_dot_product_efficient_attention" in names
    assert "aten::_scaled_dot_product_flash_attention" not in names


def test_deepseek_v3_under_tensor_parallel_splits_heads_not_latents(tmp_path):
    """tp 2 over 4 ranks: each rank attends with half the heads (2 of 4, 48 = 32 + 16 wide),
    the latent projections whole on every rank."""
    cfg = CaptureConfig(workload=WorkloadConfig(**SMALL_DEEPSEEK, parallel="fsdp2",
                                                precision="bf16_mixed", device="fake",
                                                parallelism=ParallelismConfig(tp=2)),
                        world_size=4, out_dir=str(tmp_path))
    assert run_capture_job(cfg, rank0_only=True).meta["mesh"]["description"] == \
        "dp_shard 2 x tp 2"
    trace = load_trace(tmp_path / trace_file_name(0))
    attention = [op.inputs[0].shape for op in trace.ops
                 if op.name == "aten::_scaled_dot_product_efficient_attention"]
    assert attention == [(2, 2, 16, 48)] * 3


def test_deepseek_v3_under_context_parallel_rings_the_latent_attention(tmp_path):
    """cp 2 with ep 2 over 4 ranks: each rank attends its half of the sequence (64 of 128
    positions) to the whole ring's keys and values (all-gathered per block in forward and in
    backward) with the memory-efficient kernel (values narrower than q and k), heads whole."""
    cfg = CaptureConfig(workload=WorkloadConfig(**{**SMALL_DEEPSEEK, "seq_len": 128},
                                                parallel="fsdp2", precision="bf16_mixed",
                                                device="fake",
                                                parallelism=ParallelismConfig(cp=2, ep=2)),
                        world_size=4, out_dir=str(tmp_path))
    meta = run_capture_job(cfg, rank0_only=True).meta
    assert meta["mesh"]["description"] == "dp_shard 2 x cp 2 x ep 2"
    trace = load_trace(tmp_path / trace_file_name(0))
    groups = {g.desc: g.name for g in trace.process_groups}
    attention = [(op.inputs[0].shape, op.inputs[2].shape) for op in trace.ops
                 if op.name == "aten::_scaled_dot_product_efficient_attention"]
    # per block: the local chunks, then (cp rank 0, the load balancer's causal halves) the
    # second half of its queries against the peer's keys and values
    assert attention == [((2, 4, 64, 48), (2, 4, 64, 24)), ((2, 4, 32, 48), (2, 4, 64, 24))] * 3
    ring = [op.inputs[0].shape for op in trace.ops if op.collective is not None
            and op.collective.pg_name == groups["mesh_cp"]
            and op.name == "_c10d_functional::all_gather_into_tensor"]
    assert ring == [(2 * 4 * 64 * (48 + 24),)] * 6  # keys and values, per block and pass
    # torch's ring merges the kernel's 32-row logsumexp blocks: a shorter chunk is refused
    short = dataclasses.replace(cfg.workload, seq_len=16)
    with pytest.raises(ConfigError, match=r"seq_len / 2 cp = 4 rows.*MLA's narrower values"):
        validate_parallelism(short, 4)


def test_the_ring_attends_narrower_values_as_the_whole_sequence_does():
    """On a real cpu the ring runs CPU's flash kernel on zero-padded values: a one-rank ring's
    output and gradients are plain causal attention's."""
    from actors.capture.workloads.attention import causal_attention
    from actors.capture.workloads.parallelize.context_parallel import RingAttention

    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("cp",))
        q, k = (torch.randn(2, 3, 16, 12, requires_grad=True) for _ in range(2))
        v = torch.randn(2, 3, 16, 8, requires_grad=True)
        ring = RingAttention(mesh)(q, k, v)
        ring.square().sum().backward()
        ring_grads = [t.grad.clone() for t in (q, k, v)]
        for t in (q, k, v):
            t.grad = None
        plain = causal_attention(q, k, v, "fused")
        plain.square().sum().backward()
    finally:
        dist.destroy_process_group()
    assert ring.shape == (2, 3, 16, 8)
    torch.testing.assert_close(ring, plain)
    for got, want in zip(ring_grads, (q.grad, k.grad, v.grad)):
        torch.testing.assert_close(got, want)
