"""The capture workload's config: which decoder, trained how (``WorkloadConfig``), the
deprecated ``kind`` / ``dtype`` aliases (resolved in ``WorkloadConfig.__post_init__`` only) and
the checks of what cannot run (:func:`validate`). See docs/capture.md, "Recipes"."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from actors.capture.workloads.attention import Attention
from actors.capture.workloads.checkpointing import ActivationCheckpointing
from actors.capture.workloads.mesh import ParallelismConfig
from actors.capture.workloads.models.registry import MODEL_SPECS, expert_ffn_dim, model_spec
from actors.capture.workloads.moe import MoeRouter, MoeScore, MoeSpec, max_skew
from actors.capture.workloads.optimizers import OptimizerName
from actors.choices import Choice
from actors.config_fields import setting
from actors.errors import ConfigError
from actors.gpu_arch import GpuArch
from actors.zero3.config import OffloadDevice, Zero3Config


class ModelName(Choice):
    """The decoder trained."""

    gpt = "gpt"  # learned positions, LayerNorm, GELU MLP, biases
    llama = "llama"  # RMSNorm, rotary embeddings, grouped-query attention, SwiGLU
    qwen3 = "qwen3"  # llama with per-head q/k RMSNorm, an explicit head_dim; dense or MoE
    deepseek_v3 = "deepseek_v3"  # multi-head latent attention, dense first blocks, then MoE
    llama4 = "llama4"  # llama with interleaved MoE blocks, chunked attention and NoPE blocks
    # the user's own step, workload.entrypoint (actors/capture/workloads/custom.py)
    custom = "custom"


class Parallel(Choice):
    """How ranks combine their work."""

    ddp = "ddp"  # data parallel: gradients all-reduced in buckets once per step
    fsdp2 = "fsdp2"  # torch fully_shard per block, then the root, over a 1-D mesh
    zero3 = "zero3"  # DeepSpeed ZeRO-3 (cpu or cuda)
    local = "local"  # every rank trains alone: no collectives (plain traces)


class ReshardPolicy(Choice):
    """When FSDP2 frees a block's gathered parameters after its forward (torchtitan's
    parallelism.fsdp_reshard_after_forward)."""

    default = "default"  # every block but the last (backward needs it at once); none under pp
    always = "always"  # every block, the last and pipeline stages' too: least memory
    never = "never"  # none: parameters stay gathered from forward through backward


class Float8Recipe(Choice):
    """torchao's float8 scaling recipe (Float8LinearRecipeName; torchtitan's float8.recipe_name)."""

    tensorwise = "tensorwise"  # one scale per tensor, dynamic: the cuBLAS tensorwise kernel
    rowwise = "rowwise"  # a scale per row, e4m3 everywhere, power-of-two scales
    rowwise_with_gw_hp = "rowwise_with_gw_hp"  # rowwise, the weight gradient in bf16


class Precision(Choice):
    """Parameter, compute and optimizer dtypes."""

    fp32 = "fp32"
    bf16 = "bf16"  # bf16 parameters, gradients and AdamW state
    fp16 = "fp16"  # float16 parameters, gradients and AdamW state (ddp, local)
    # bf16 compute, fp32 parameters (master weights), optimizer state and gradient reduction:
    # autocast (ddp, local), MixedPrecisionPolicy (fsdp2), DeepSpeed's bf16 mode (zero3).
    bf16_mixed = "bf16_mixed"


class WorkloadKind(Choice):
    """Deprecated ``<model>_<parallel>`` names: ``workload.kind`` sets model and parallel."""

    gpt_dp = "gpt_dp"
    gpt_zero3 = "gpt_zero3"
    gpt_local = "gpt_local"
    llama_dp = "llama_dp"
    llama_zero3 = "llama_zero3"
    llama_local = "llama_local"
    custom = "custom"  # = workload.model=custom



class WorkloadDevice(Choice):
    """Where the model lives while capturing."""

    cpu = "cpu"
    cuda = "cuda"  # one GPU per rank (LOCAL_RANK), NCCL
    meta = "meta"  # shapes only: no data, no memory, fake process group (any world size)
    fake = "fake"  # like meta, but tensors report cpu (FakeTensorMode): FSDP2 runs too


class DType(Choice):
    """Deprecated ``workload.dtype`` values: each names a pure precision."""

    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


_KIND_PARALLEL = {"dp": Parallel.ddp, "zero3": Parallel.zero3, "local": Parallel.local}
_DTYPE_PRECISION = {DType.float32: Precision.fp32, DType.bfloat16: Precision.bf16,
                    DType.float16: Precision.fp16}
PARAM_DTYPES = {Precision.fp32: torch.float32, Precision.bf16: torch.bfloat16,
                Precision.fp16: torch.float16, Precision.bf16_mixed: torch.float32}


@dataclass
class WorkloadConfig:
    """What to train while capturing."""

    model: ModelName = setting(ModelName.gpt, help=(
        "The decoder family (actors/capture/workloads/models/): gpt, llama, qwen3 or deepseek_v3; "
        "custom: the user's own step (workload.entrypoint)."))
    entrypoint: str = setting("", help=(
        "model=custom: the user's step, PATH.py:FUNCTION or package.module:FUNCTION, whose "
        "build(ctx) returns (model, make_batch, step) (see actors/capture/workloads/custom.py). "
        "The model and recipe knobs below do not apply to it."))
    parallel: Parallel = setting(Parallel.ddp, help=(
        "ddp, fsdp2, zero3 or local (no gradient communication)."))
    parallelism: ParallelismConfig = setting(factory=ParallelismConfig, help=(
        "The device mesh (torchtitan's degrees: dp_replicate, dp_shard, tp, pp, cp, ep; their "
        "product is world_size, dp_shard=-1 the rest): actors/capture/workloads/mesh.py. The "
        "default, only dp_shard, is the 1-D data-parallel job every recipe ran before."))
    reshard_after_forward: ReshardPolicy = setting(ReshardPolicy.default, help=(
        "fsdp2: default (every block's gathered parameters freed after its forward but the "
        "last's; none under pp), always or never (kept from forward to backward: no second "
        "all-gather, a whole model's bf16 copy held)."))
    float8: bool = setting(False, help=(
        "torchao float8 training: the Linears but the output as Float8Linear (dynamic scaling "
        "by workload.float8_recipe), FSDP2's all-gathers as workload.float8_all_gather says "
        "(actors/capture/workloads/parallelize/float8.py; torchtitan's float8 converter). Needs "
        "fsdp2, bf16_mixed and the fake device (or cuda)."))
    float8_recipe: Float8Recipe = setting(Float8Recipe.tensorwise, help=(
        "workload.float8's scaling: tensorwise, rowwise or rowwise_with_gw_hp (torchao's "
        "Float8LinearRecipeName, torchtitan's float8.recipe_name)."))
    float8_all_gather: Optional[bool] = setting(None, help=(
        "workload.float8 under fsdp2: true all-gathers the weights in float8 (torchao's "
        "enable_fsdp_float8_all_gather: half of bf16's bytes; tensorwise only), false in bf16 "
        "(each weight cast after its gather); null: the recipe's way, float8 for tensorwise, "
        "bf16 for the rowwise recipes."))
    cpu_offload: bool = setting(False, help=(
        "fsdp2: FSDP2's CPUOffloadPolicy (torchtitan's training.enable_cpu_offload): parameter "
        "shards, their gradients and the optimizer state (and its step) in host memory. "
        "tracefleet-predict counts those storages as host bytes, not the GPU's."))
    optimizer: OptimizerName = setting(OptimizerName.adamw, help=(
        "The built-in recipes' optimizer: adamw (torch's), adamw_8bit or adamw_4bit (torchao's "
        "low-bit AdamW: block-wise quantized moments; its compiled step runs on fake as "
        "workload.compile's does). Not on meta, nor zero3 (DeepSpeed's own optimizer) or a "
        "custom step (its own)."))
    activation_offload: bool = setting(False, help=(
        "Every tensor saved for backward copied to host memory in forward and back to the "
        "device when backward needs it (torch.autograd.graph.save_on_cpu's way; "
        "actors/capture/workloads/activation_offload.py). tracefleet-predict counts the host "
        "copies as host bytes, not the GPU's. ddp, fsdp2 or local, no activation "
        "checkpointing, no pp."))
    optimizer_in_backward: bool = setting(False, help=(
        "fsdp2: each parameter's AdamW step runs in backward as soon as its gradient shard is "
        "reduced, and the gradient is freed right after (torchtitan's "
        "optimizer.early_step_in_backward: a post-accumulate-grad hook per parameter; "
        "actors/capture/workloads/optimizer_in_backward.py): no step holds the whole model's "
        "gradients. Not with grad_accum_steps > 1 or pp."))
    precision: Precision = setting(Precision.fp32, help=(
        "fp32, bf16 (pure), fp16 (pure) or bf16_mixed (bf16 compute, fp32 masters and "
        "reduction)."))
    activation_checkpointing: ActivationCheckpointing = setting(ActivationCheckpointing.none, help=(
        "none, full, selective_layer (every ac_every-th block) or selective_op "
        "(docs/capture.md)."))
    ac_every: int = setting(2, help="selective_layer: checkpoint every ac_every-th block.")
    compile: bool = setting(False, help=(
        "torch.compile every decoder block (inductor, after activation checkpointing, before "
        "sharding: torchtitan's compile.enable with model in compile.components). On fake "
        "inductor's plan of buffers is recorded (actors/capture/fake/compiled_on_fake.py). "
        "Built-in models on a 1-D mesh (local, ddp, fsdp2); not zero3, float8 or N-D meshes yet."))
    grad_accum_steps: int = setting(1, help=(
        "Micro-batches per optimizer step; gradients are communicated once, after the last "
        "(ddp: no_sync, fsdp2: set_requires_gradient_sync(False) before; zero3: DeepSpeed's "
        "own)."))
    kind: Optional[WorkloadKind] = setting(None, help=(
        "Deprecated: <model>_<dp|zero3|local>; when set it replaces model and parallel and is "
        "then cleared (meta.json records model and parallel)."))
    dtype: Optional[DType] = setting(None, help=(
        "Deprecated: float32, bfloat16 or float16; when set it replaces precision (fp32, bf16, "
        "fp16) and is then cleared."))
    device: WorkloadDevice = setting(WorkloadDevice.cpu, help=(
        "cpu, cuda (one GPU per rank), meta (shapes only; 70B-class models in seconds) or fake "
        "(shapes only on fake cpu tensors, any world size; see actors/capture/fake/fake_mode.py)."))
    gpu_kernels: Optional[GpuArch] = setting(None, help=(
        "meta/fake: run what a GPU runs otherwise than a CPU as CUDA does on this architecture "
        "(sm80, sm86, sm89, sm90, sm100, sm120; actors/capture/fake/cuda_dispatch.py): scaled "
        "dot product attention, dropout, autocast regions (cuda's entered, CUDA's cast policy), "
        "torch.optim's default implementation (foreach; the built-in recipes' AdamW fused), "
        "compiled FlexAttention (inductor's Triton kernels' buffers); "
        "null: the CPU's. tracefleet-predict sets it from target.arch."))
    check_fake: bool = setting(False, help=(
        "device=fake, tracefleet-capture: also run the same workload for real on cpu at world 2 "
        "and compare its op sequence and output sizes with a fake capture at world 2, naming "
        "the first divergence (orchestrator/run/fake_check.py; make the model small for it)."))
    vocab: int = setting(512, help="Vocabulary size (token embedding rows, LM head outputs).")
    d_model: int = setting(128, help="Hidden size.")
    n_layers: int = setting(2, help="Number of decoder blocks.")
    n_heads: int = setting(4, help=(
        "Attention heads per block (must divide d_model unless head_dim is set)."))
    head_dim: int = setting(0, help=(
        "llama, qwen3: each attention head's size; 0 = d_model / n_heads. Qwen3: 128 (its "
        "heads x head_dim need not be d_model)."))
    tie_embeddings: bool = setting(False, help=(
        "llama, qwen3: the output projection shares the token embedding's weight (Llama 3.2 "
        "1B/3B, Qwen3 up to 4B). Not with tp or pp (their plans split the two apart)."))
    loss_chunks: int = setting(1, help=(
        "llama, qwen3: the cross-entropy computed over this many slices of the tokens, each "
        "slice's float32 logits recomputed in backward, so the batch's vocabulary-wide logits "
        "are never held at once (a chunked loss, torchtitan's / Liger's); 1 = whole. Not with "
        "tp (loss parallel shards the logits instead) or pp."))
    n_kv_heads: int = setting(0, help=(
        "llama: key/value heads (grouped-query attention; must divide n_heads); 0 = n_heads."))
    ffn_dim: int = setting(0, help=(
        "Hidden size of the feed-forward block; 0 = the model's rule (gpt: 4 x d_model; llama: "
        "2/3 of 4 x d_model rounded up to a multiple of 256, as Meta's reference)."))
    seq_len: int = setting(64, help=(
        "Tokens per sample (gpt: also the number of learned positions)."))
    batch_size: int = setting(4, help=(
        "Samples per rank per micro-batch (DeepSpeed's train_micro_batch_size_per_gpu)."))
    attention: Attention = setting(Attention.fused, help=(
        "fused (one flash kernel, nothing seq x seq kept) or math (explicit softmax)."))
    moe_experts: int = setting(0, help=(
        "llama: routed experts of every block's feed-forward, a Mixture of Experts (a router "
        "and top-k SwiGLU experts, Mixtral / DeepSeek-like: actors/capture/workloads/moe.py); 0 = "
        "the dense SwiGLU. parallelism.ep splits them over ranks (expert parallel)."))
    moe_top_k: int = setting(2, help="moe_experts > 0: experts each token is routed to.")
    moe_ffn_dim: int = setting(0, help=(
        "moe_experts > 0: each expert's hidden size; 0 = ffn_dim's rule."))
    moe_shared_experts: int = setting(0, help=(
        "moe_experts > 0: shared experts every token also runs (DeepSeek's), 0 = none."))
    moe_dense_layers: int = setting(0, help=(
        "moe_experts > 0: the first this many blocks keep the dense feed-forward (ffn_dim "
        "wide); DeepSeek-V3: 3, its 16B: 1."))
    moe_every: int = setting(1, help=(
        "moe_experts > 0: every moe_every-th block (counting from 1) past moe_dense_layers is "
        "MoE, the others dense (ffn_dim wide); Llama 4 Maverick: 2, Scout: 1 (torchtitan's "
        "interleave_moe_layer_step)."))
    moe_score: MoeScore = setting(MoeScore.softmax, help=(
        "moe_experts > 0: softmax over the experts, or sigmoid per expert (DeepSeek-V3; the "
        "chosen scores renormalized)."))
    moe_groups: int = setting(0, help=(
        "moe_experts > 0: node-limited routing (DeepSeek-V3: 8): the experts in this many "
        "groups, a token's experts chosen within its moe_limited_groups best; 0 = no groups. "
        "The routing assumption's loads are unchanged by it (actors/capture/workloads/moe.py)."))
    moe_limited_groups: int = setting(0, help=(
        "moe_groups > 0: the groups a token may use (DeepSeek-V3: 4)."))
    attention_chunk: int = setting(0, help=(
        "llama4: the blocks with rotary embeddings attend within chunks of this many tokens "
        "(Llama 4: 8192, torchtitan's fixed_attn_block_size); 0 = the whole causal sequence."))
    nope_every: int = setting(0, help=(
        "llama4: every nope_every-th block (counting from 1) has no rotary embedding and "
        "attends to the whole causal sequence (Llama 4: 4, torchtitan's every_n_layers_nope); "
        "0 = none."))
    mla_kv_lora_rank: int = setting(0, help=(
        "deepseek_v3: the latent keys and values are made from (multi-head latent attention; "
        "DeepSeek-V3: 512). head_dim is the non-rotated part of a query/key head (128)."))
    mla_q_lora_rank: int = setting(0, help=(
        "deepseek_v3: the queries' low-rank bottleneck (DeepSeek-V3: 1536); 0 = one projection "
        "(its 16B)."))
    mla_rope_head_dim: int = setting(64, help=(
        "deepseek_v3: the rotated part of each query/key head, its key shared by the heads."))
    mla_v_head_dim: int = setting(0, help=(
        "deepseek_v3: each head's value size; 0 = head_dim."))
    moe_router: MoeRouter = setting(MoeRouter.topk, help=(
        "moe_experts > 0: topk (the gate's best top_k scores per token; on fake and meta, where "
        "the choice has no value, the routing assumption's loads stand for it) or fixed (the "
        "assumption's loads imposed on every run, real ones included: a real run that routes as "
        "its fake capture assumes)."))
    moe_routing_skew: float = setting(0.0, help=(
        "The routing assumption: expert 0 receives (1 + skew) x the mean load, the others share "
        "the rest equally; 0 = balanced, at most moe_experts / moe_top_k - 1 (every token)."))
    rope_theta: float = setting(500000.0, help="llama: rotary embedding base.")
    norm_eps: float = setting(1e-5, help="llama: RMSNorm epsilon.")
    lr: float = setting(1e-3, help="AdamW learning rate.")
    seed: int = setting(0, help=(
        "Model init seed, the same on every rank; rank r draws its batches from seed + 1 + r."))
    dp_bucket_numel: int = setting(0, help=(
        "ddp: 0 = one all-reduce per gradient; > 0 = gradients packed (in backward order) into "
        "flat buckets of at most this many elements, one all-reduce each (like DDP)."))
    leaf_modules: bool = setting(False, help=(
        "zero3: mark each decoder block a ZeRO-3 leaf module (one fetch per block)."))
    zero3_param_persistence_threshold: int = setting(0, help=(
        "zero3: parameters with fewer elements stay gathered "
        "(stage3_param_persistence_threshold)."))
    zero3_prefetch_bucket_size: int = setting(0, help=(
        "zero3: elements fetched ahead of use; 0 fetches each module when it runs."))
    zero3_max_reuse_distance: int = setting(0, help=(
        "zero3: keep parameters gathered when reused within this many elements; 0 releases them "
        "after every use, so backward fetches them again."))
    zero3_reduce_bucket_size: int = setting(200_000, help=(
        "zero3: gradient elements per reduce-scatter bucket (reduce_bucket_size)."))
    zero3_offload_optimizer: OffloadDevice = setting(OffloadDevice.none, help=(
        "zero3: DeepSpeed's offload_optimizer.device (cpu: the fp32 master partition, moments "
        "and gradient partitions in host memory, the update there; DeepSpeed's torch AdamW "
        "kept)."))
    zero3_offload_param: OffloadDevice = setting(OffloadDevice.none, help=(
        "zero3: DeepSpeed's offload_param.device (cpu: the parameter partitions in host "
        "memory)."))
    build_shm_op: bool = setting(False, help=(
        "zero3: let DeepSpeed JIT-build its CPU shm comm op (30-90 s with g++ the first time; "
        "skipped if the build fails). Off by default: only DeepSpeed's inference all-reduce "
        "uses it, so a training trace is the same without it."))
    zero3_emulation: Zero3Config = setting(factory=Zero3Config, help=(
        "Not a capture knob: the ZeRO-3 emulation a replay of this workload's (plain, "
        "parallel=local) traces runs under to stand for a ZeRO-3 job, e.g. DeepSpeed's, which "
        "cannot run on meta or fake (conf/workload/deepspeed_70b.yaml). tracefleet-predict "
        "applies it with zero3.world_size = the job's world size; strategy none (the default): "
        "the traces replay as recorded. The capture ignores it."))

    def __post_init__(self):
        if isinstance(self.zero3_emulation, dict):  # rebuilt from asdict (meta.json, ranks)
            self.zero3_emulation = Zero3Config(**self.zero3_emulation)
        if isinstance(self.parallelism, dict):
            self.parallelism = ParallelismConfig(**self.parallelism)
        self.model = ModelName.coerce(self.model, "workload.model")
        self.parallel = Parallel.coerce(self.parallel, "workload.parallel")
        self.precision = Precision.coerce(self.precision, "workload.precision")
        self.activation_checkpointing = ActivationCheckpointing.coerce(
            self.activation_checkpointing, "workload.activation_checkpointing")
        self.device = WorkloadDevice.coerce(self.device, "workload.device")
        if self.gpu_kernels is not None:
            self.gpu_kernels = GpuArch.coerce(self.gpu_kernels, "workload.gpu_kernels")
        self.attention = Attention.coerce(self.attention, "workload.attention")
        self.moe_router = MoeRouter.coerce(self.moe_router, "workload.moe_router")
        self.moe_score = MoeScore.coerce(self.moe_score, "workload.moe_score")
        self.reshard_after_forward = ReshardPolicy.coerce(self.reshard_after_forward,
                                                          "workload.reshard_after_forward")
        self.float8_recipe = Float8Recipe.coerce(self.float8_recipe, "workload.float8_recipe")
        self.optimizer = OptimizerName.coerce(self.optimizer, "workload.optimizer")
        for name in ("zero3_offload_optimizer", "zero3_offload_param"):
            setattr(self, name, OffloadDevice.coerce(getattr(self, name), f"workload.{name}"))
        # The deprecated aliases, resolved here and only here. An alias replaces fields left at
        # their defaults (a preset's model too, when it agrees); a field set to something else
        # is a contradiction, refused rather than silently overridden.
        if self.kind is not None:
            kind = WorkloadKind.coerce(self.kind, "workload.kind")
            if kind == WorkloadKind.custom:
                self.model, self.kind = ModelName.custom, None
                return
            model, parallel = kind.value.split("_")
            _refuse_clashes(f"workload.kind={kind}", (
                ("model", self.model, ModelName(model), ModelName.gpt),
                ("parallel", self.parallel, _KIND_PARALLEL[parallel], Parallel.ddp)))
            self.model, self.parallel, self.kind = ModelName(model), _KIND_PARALLEL[parallel], None
        if self.dtype is not None:
            dtype = DType.coerce(self.dtype, "workload.dtype")
            _refuse_clashes(f"workload.dtype={dtype}", (
                ("precision", self.precision, _DTYPE_PRECISION[dtype], Precision.fp32),))
            self.precision, self.dtype = _DTYPE_PRECISION[dtype], None


def _refuse_clashes(alias: str, fields: tuple) -> None:
    """ConfigError when a field (name, value, what the alias implies, default) contradicts it."""
    clashes = [f"workload.{name}={value}" for name, value, implied, default in fields
               if value not in (implied, default)]
    if clashes:
        implied = " ".join(f"{name}={implied}" for name, _, implied, _ in fields)
        raise ConfigError(f"{alias} (deprecated) means {implied}, but {', '.join(clashes)} is "
                          f"set; drop {alias.split('=')[0]}")


def validate(cfg: WorkloadConfig) -> None:
    """Raise ConfigError when the workload knobs are inconsistent."""
    if cfg.check_fake and cfg.device != WorkloadDevice.fake:
        raise ConfigError(f"workload.check_fake=true compares a fake capture with a real one; "
                          f"it needs workload.device=fake (got {cfg.device})")
    if cfg.gpu_kernels is not None and cfg.device not in (WorkloadDevice.meta,
                                                          WorkloadDevice.fake):
        raise ConfigError(f"workload.gpu_kernels={cfg.gpu_kernels} dispatches shapes-only "
                          f"tensors as a GPU would; workload.device={cfg.device} runs its own "
                          "kernels (use device=fake, or leave gpu_kernels null)")
    if cfg.optimizer != OptimizerName.adamw and (
            cfg.device == WorkloadDevice.meta or cfg.parallel == Parallel.zero3
            or cfg.model == ModelName.custom):
        raise ConfigError(f"workload.optimizer={cfg.optimizer} with workload.parallel="
                          f"{cfg.parallel}, model={cfg.model}, device={cfg.device}: torchao's "
                          "low-bit AdamW steps a compiled function, which needs fake, cpu or "
                          "cuda tensors (not meta); zero3 steps DeepSpeed's optimizer and a "
                          "custom step its own")
    if cfg.activation_offload and cfg.model == ModelName.custom:
        raise ConfigError("workload.activation_offload=true with workload.model=custom: the "
                          "offload hooks wrap the built-in steps' forward; a custom step "
                          "offloads in its own code (torch.autograd.graph.save_on_cpu)")
    if cfg.model == ModelName.custom:
        if not cfg.entrypoint:
            raise ConfigError("workload.model=custom needs workload.entrypoint=PATH.py:FUNCTION "
                              "(or package.module:FUNCTION)")
        if cfg.device == WorkloadDevice.meta:
            raise ConfigError("workload.model=custom on workload.device=meta: FSDP2 and DDP "
                              "refuse meta tensors; use workload.device=fake (shapes only too)")
        return
    if cfg.entrypoint:
        raise ConfigError(f"workload.entrypoint={cfg.entrypoint!r} is only read with "
                          f"workload.model=custom (got workload.model={cfg.model}); use "
                          "workload=custom")
    for name in ("vocab", "d_model", "n_layers", "n_heads", "seq_len", "batch_size",
                 "ac_every", "grad_accum_steps"):
        if getattr(cfg, name) < 1:
            raise ConfigError(f"workload.{name}={getattr(cfg, name)}: must be >= 1")
    for name in ("dp_bucket_numel", "n_kv_heads", "ffn_dim", "head_dim", "moe_dense_layers",
                 "moe_groups", "moe_limited_groups", "mla_kv_lora_rank", "mla_q_lora_rank",
                 "mla_v_head_dim", "attention_chunk", "nope_every"):
        if getattr(cfg, name) < 0:
            raise ConfigError(f"workload.{name}={getattr(cfg, name)}: must be >= 0")
    if cfg.loss_chunks < 1:
        raise ConfigError(f"workload.loss_chunks={cfg.loss_chunks}: must be >= 1 (1 = the "
                          "whole loss at once)")
    irope = [f"workload.{n}={getattr(cfg, n)}" for n in ("attention_chunk", "nope_every")
             if getattr(cfg, n)]
    if irope and cfg.model != ModelName.llama4:
        raise ConfigError(f"{', '.join(irope)}: chunked attention and NoPE blocks are "
                          f"workload.model=llama4's (got {cfg.model})")
    model_spec(cfg.model).validate(cfg)
    _validate_moe(cfg)
    _validate_recipe(cfg)


def _validate_moe(cfg: WorkloadConfig) -> None:
    """The MoE knobs (moe_*): ranges, and a family with an MoE block."""
    if cfg.moe_experts < 0 or cfg.moe_ffn_dim < 0 or cfg.moe_shared_experts < 0:
        raise ConfigError(f"workload.moe_experts={cfg.moe_experts}, moe_ffn_dim="
                          f"{cfg.moe_ffn_dim}, moe_shared_experts={cfg.moe_shared_experts}: "
                          "must be >= 0")
    if not cfg.moe_experts:
        return
    if not model_spec(cfg.model).moe:
        families = ", ".join(name for name, spec in MODEL_SPECS.items() if spec.moe)
        raise ConfigError(f"workload.moe_experts={cfg.moe_experts}: workload.model={cfg.model} "
                          f"has no MoE block (the families with one: {families})")
    if not 1 <= cfg.moe_top_k <= cfg.moe_experts:
        raise ConfigError(f"workload.moe_top_k={cfg.moe_top_k}: must be 1 to moe_experts="
                          f"{cfg.moe_experts}")
    if cfg.moe_every < 1:
        raise ConfigError(f"workload.moe_every={cfg.moe_every}: must be >= 1 (1 = every block)")
    if not 0 <= cfg.moe_dense_layers <= cfg.n_layers:
        raise ConfigError(f"workload.moe_dense_layers={cfg.moe_dense_layers}: must be 0 to "
                          f"n_layers={cfg.n_layers}")
    if cfg.moe_groups:
        if cfg.moe_experts % cfg.moe_groups or not 1 <= cfg.moe_limited_groups <= cfg.moe_groups:
            raise ConfigError(f"workload.moe_groups={cfg.moe_groups}, moe_limited_groups="
                              f"{cfg.moe_limited_groups}: the groups must split moe_experts="
                              f"{cfg.moe_experts} evenly, and 1 to moe_groups of them be used")
        usable = cfg.moe_limited_groups * cfg.moe_experts // cfg.moe_groups
        if cfg.moe_top_k > usable:
            raise ConfigError(f"workload.moe_top_k={cfg.moe_top_k} experts cannot be chosen "
                              f"within {cfg.moe_limited_groups} groups of "
                              f"{cfg.moe_experts // cfg.moe_groups}")
    most = max_skew(cfg.moe_top_k, cfg.moe_experts)
    if not 0 <= cfg.moe_routing_skew <= most:
        raise ConfigError(f"workload.moe_routing_skew={cfg.moe_routing_skew}: must be 0 to "
                          f"moe_experts / moe_top_k - 1 = {most:g} (the hot expert then gets "
                          "every token)")


def moe_spec(cfg: WorkloadConfig) -> MoeSpec | None:
    """The MoE block ``cfg`` asks for (None: the dense feed-forward)."""
    if not cfg.moe_experts:
        return None
    return MoeSpec(cfg.moe_experts, cfg.moe_top_k, expert_ffn_dim(cfg),
                   cfg.moe_shared_experts, cfg.moe_router, float(cfg.moe_routing_skew),
                   model_spec(cfg.model).moe_normalize_top_k, cfg.moe_score, cfg.moe_groups,
                   cfg.moe_limited_groups)


def _validate_recipe(cfg: WorkloadConfig) -> None:
    """The parallel x precision x device combinations that cannot run."""
    where = f"workload.parallel={cfg.parallel}"
    if cfg.device == WorkloadDevice.fake and cfg.parallel == Parallel.zero3:
        raise ConfigError(f"{where} runs DeepSpeed, which needs real tensors; on "
                          "workload.device=fake use workload.parallel=local (plain traces for "
                          "the ZeRO-3 emulation), ddp or fsdp2")
    if cfg.device == WorkloadDevice.meta:
        if cfg.parallel == Parallel.zero3:
            raise ConfigError(f"{where} runs DeepSpeed, which needs real tensors; on "
                              "workload.device=meta use workload.parallel=local (plain traces "
                              "for the ZeRO-3 emulation) or ddp")
        if cfg.parallel == Parallel.fsdp2:
            raise ConfigError(f"{where} refuses parameters on the meta device (FSDP2 checks "
                              "them when the step runs); use workload.device=fake")
        if cfg.precision == Precision.bf16_mixed:
            raise ConfigError("workload.precision=bf16_mixed runs under torch.autocast, which "
                              "has no meta backend (a meta trace would run in float32); use "
                              "workload.device=fake, or precision=bf16 for pure bf16")
    if cfg.float8 and (cfg.parallel != Parallel.fsdp2 or cfg.precision != Precision.bf16_mixed
                       or cfg.device not in (WorkloadDevice.fake, WorkloadDevice.cuda)):
        raise ConfigError(f"workload.float8=true with {where}, precision={cfg.precision}, "
                          f"device={cfg.device}: float8 training is torchtitan's bf16_mixed "
                          "FSDP2 recipe with float8 linears, on fake (or cuda: _scaled_mm has "
                          "no cpu kernel for it here)")
    if cfg.float8 and cfg.float8_all_gather and cfg.float8_recipe != Float8Recipe.tensorwise:
        raise ConfigError(f"workload.float8_all_gather=true with float8_recipe="
                          f"{cfg.float8_recipe}: torchao gathers float8 weights with tensorwise "
                          "scales only; set float8_all_gather=false (or null: bf16 gathers)")
    if cfg.compile and (cfg.model == ModelName.custom or cfg.parallel == Parallel.zero3
                        or cfg.float8 or cfg.device == WorkloadDevice.meta
                        or not cfg.parallelism.is_one_dim()):
        mesh = "1-D" if cfg.parallelism.is_one_dim() else "N-D (workload.parallelism)"
        raise ConfigError(f"workload.compile=true with {where}, model={cfg.model}, "
                          f"device={cfg.device}, float8={cfg.float8}, a {mesh} mesh: "
                          "compiled blocks are built for the "
                          "built-in models on a 1-D mesh (parallel local, ddp or fsdp2) on fake, "
                          "cpu or cuda; a custom step compiles itself (torch.compile in its "
                          "build)")
    if cfg.optimizer_in_backward and (cfg.parallel != Parallel.fsdp2 or cfg.grad_accum_steps > 1
                                      or cfg.parallelism.pp > 1):
        raise ConfigError(f"workload.optimizer_in_backward=true with {where}, grad_accum_steps="
                          f"{cfg.grad_accum_steps}, pp={cfg.parallelism.pp}: the step in "
                          "backward is FSDP2's (its reduce-scatter runs the parameter's hook), "
                          "once per step: use parallel=fsdp2, grad_accum_steps=1 and no pp "
                          "(torchtitan refuses the same)")
    if cfg.activation_offload and (cfg.parallel == Parallel.zero3 or cfg.parallelism.pp > 1
                                   or cfg.activation_checkpointing != ActivationCheckpointing.none
                                   or cfg.device == WorkloadDevice.meta):
        raise ConfigError(f"workload.activation_offload=true with {where}, pp="
                          f"{cfg.parallelism.pp}, activation_checkpointing="
                          f"{cfg.activation_checkpointing}, device={cfg.device}: the offload "
                          "hooks wrap the built-in ddp, fsdp2 or local step's forward, without "
                          "checkpointing (whose own hooks decide what is saved) or a pipeline "
                          "schedule, on fake, cpu or cuda")
    if cfg.cpu_offload and cfg.parallel != Parallel.fsdp2:
        raise ConfigError(f"workload.cpu_offload=true is FSDP2's CPUOffloadPolicy; {where} "
                          "(DeepSpeed's: workload.zero3_offload_optimizer / zero3_offload_param "
                          "on zero3, zero3_emulation.offload_* for its emulation)")
    offloaded = [f"workload.{n}={getattr(cfg, n)}" for n in ("zero3_offload_optimizer",
                                                               "zero3_offload_param")
                 if getattr(cfg, n) != OffloadDevice.none]
    if offloaded and cfg.parallel != Parallel.zero3:
        raise ConfigError(f"{', '.join(offloaded)} is DeepSpeed's offload; {where} (FSDP2's: "
                          "workload.cpu_offload)")
    if cfg.parallel == Parallel.zero3 and cfg.precision in (Precision.bf16, Precision.fp16):
        raise ConfigError(f"{where} with workload.precision={cfg.precision}: DeepSpeed keeps "
                          "fp32 master weights in its optimizer; use precision=bf16_mixed "
                          "(DeepSpeed's bf16 mode) or fp32")
