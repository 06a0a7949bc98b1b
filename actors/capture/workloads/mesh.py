"""The job's device mesh: ``workload.parallelism`` (torchtitan's names), checked, and built.

``dp_replicate x dp_shard x cp x tp x pp = world_size`` (``dp_shard=-1`` takes the rest), as
torchtitan's ``ParallelDims``. The mesh has one named dimension per degree above 1, in
torchtitan's order ``pp, dp_replicate, dp_shard, cp, tp`` (ranks are laid out row-major over
them: ``tp`` neighbours are adjacent ranks), and flattened dimensions built from them:

* ``dp``: ``(dp_replicate, dp_shard)``, the batch dimension (ranks that read different data);
* ``dp_shard_cp``: ``(dp_shard, cp)``, FSDP's shard dimension (torchtitan shards parameters
  over context-parallel ranks too);
* ``dp_cp``: ``(dp_replicate, dp_shard, cp)``, where the loss and gradients are averaged.

A flattened name exists when it joins two or more present dimensions. Expert parallelism
(``ep``) borrows ``dp_shard x cp`` ranks, as torchtitan's does: with ``ep > 1`` the mesh also
carries ``mesh.expert_mesh``, ``(pp, dp_replicate, efsdp, ep)`` over the same ranks (``efsdp =
dp_shard x cp / ep``; ``ep`` neighbours are the innermost ranks of ``dp_shard x cp``; under tp
``etp = tp`` innermost, so an ep group is one tp index's ranks), where
the MoE blocks' experts are split and sharded
(actors/capture/workloads/parallelize/expert_parallel.py).

With only ``dp_shard`` (the default) the mesh stays the 1-D mesh over all ranks that FSDP2 and
custom steps always had (:func:`actors.capture.workloads.context.world_mesh`).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

from actors.choices import Choice
from actors.config_fields import setting
from actors.errors import ConfigError
from actors.capture.workloads.context import world_mesh
from actors.capture.workloads.models.registry import expert_ffn_dim, model_spec

# torchtitan's order of the mesh dimensions, outermost first.
DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
# Flattened dimensions: name -> the dimensions joined (those present).
FLATTENED = {"dp": ("dp_replicate", "dp_shard"), "dp_shard_cp": ("dp_shard", "cp"),
             "dp_cp": ("dp_replicate", "dp_shard", "cp")}


class PipelineSchedule(Choice):
    """torch.distributed.pipelining's schedules (pp > 1)."""

    gpipe = "gpipe"  # every micro-batch's forward, then every backward
    f1b1 = "1f1b"  # one forward, one backward, after a warm-up of pp - 1 - stage forwards
    interleaved_1f1b = "interleaved_1f1b"  # 1f1b over several stages per rank (looped)


@dataclass
class ParallelismConfig:
    """How the ranks are arranged (torchtitan's ``parallelism`` degrees)."""

    dp_replicate: int = setting(1, help=(
        "Replicas of the model that only all-reduce gradients (HSDP's replicate dimension)."))
    dp_shard: int = setting(-1, help=(
        "FSDP's shard degree; -1 = whatever world_size leaves (world / the other degrees)."))
    tp: int = setting(1, help=(
        "Tensor parallel (Megatron-style, with sequence parallel on the norms and loss "
        "parallel)."))
    pp: int = setting(1, help=(
        "Pipeline stages (each rank holds consecutive layers; see pp_schedule)."))
    cp: int = setting(1, help=(
        "Context parallel: the sequence split over ranks, ring attention between them."))
    ep: int = setting(1, help=(
        "Expert parallel: the MoE blocks' experts (workload.moe_experts) split over this many "
        "of the dp_shard x cp ranks, tokens exchanged by all-to-all."))
    pp_schedule: str = setting(PipelineSchedule.f1b1.value, help=(
        "pp > 1: the pipeline schedule, gpipe, 1f1b or interleaved_1f1b. A string checked when "
        "the config is built (a ConfigError before any work): Hydra matches an Enum field by "
        "member name, and \"1f1b\", torch's and torchtitan's name, cannot be one."))
    pp_microbatches: int = setting(0, help=(
        "pp > 1: micro-batches per step (0 = pp: one per stage). Each is batch_size samples."))
    pp_stages_per_rank: int = setting(1, help=(
        "pp > 1: model chunks (stages) per rank; interleaved_1f1b needs >= 2, the others 1."))

    def __post_init__(self):
        self.pp_schedule = PipelineSchedule.coerce(self.pp_schedule,
                                                   "workload.parallelism.pp_schedule")

    def degrees(self, world_size: int) -> dict[str, int]:
        """``{dim: degree}`` for every dimension of DIMS, dp_shard resolved; ConfigError when
        the product is not ``world_size``."""
        fixed = {"pp": self.pp, "dp_replicate": self.dp_replicate, "cp": self.cp, "tp": self.tp}
        for name, value in (*fixed.items(), ("ep", self.ep)):
            if value < 1:
                raise ConfigError(f"workload.parallelism.{name}={value}: must be >= 1")
        others = fixed["pp"] * fixed["dp_replicate"] * fixed["cp"] * fixed["tp"]
        shard = self.dp_shard
        if shard == -1:
            if world_size % others:
                raise ConfigError(self._product_message(world_size, "-1 (the rest)") +
                                  f": {world_size} is not divisible by {others}")
            shard = world_size // others
        elif shard < 1:
            raise ConfigError(f"workload.parallelism.dp_shard={shard}: must be >= 1, or -1 for "
                              "what world_size leaves")
        if shard * others != world_size:
            raise ConfigError(self._product_message(world_size, shard) +
                              f" = {shard * others}")
        return {"pp": self.pp, "dp_replicate": self.dp_replicate, "dp_shard": shard,
                "cp": self.cp, "tp": self.tp}

    def _product_message(self, world_size: int, shard) -> str:
        return (f"workload.parallelism: pp({self.pp}) x dp_replicate({self.dp_replicate}) x "
                f"dp_shard({shard}) x cp({self.cp}) x tp({self.tp}) must equal "
                f"world_size={world_size}")

    def is_one_dim(self) -> bool:
        """Only dp_shard: the plain 1-D mesh over all ranks (no named dimensions)."""
        return (self.dp_replicate, self.tp, self.pp, self.cp, self.ep) == (1,) * 5

    def describe(self, world_size: int) -> str:
        """``dp_shard 2 x tp 2``: the degrees above 1 (``dp_shard N`` for a 1-D mesh)."""
        degrees = self.degrees(world_size)
        parts = [f"{name} {d}" for name, d in degrees.items() if d > 1]
        if self.ep > 1:
            parts.append(f"ep {self.ep}")
        return " x ".join(parts) or f"dp_shard {world_size}"


def mesh_dims(par: ParallelismConfig, world_size: int) -> list[tuple[str, int]]:
    """The mesh's own dimensions, ``(name, degree)`` outermost first (degrees above 1; one
    ``dp_shard`` dimension of size 1 for a single rank)."""
    dims = [(n, d) for n, d in par.degrees(world_size).items() if d > 1]
    return dims or [("dp_shard", 1)]


def coordinates(par: ParallelismConfig, world_size: int, rank: int) -> dict[str, int]:
    """Rank ``rank``'s index along every dimension of DIMS (0 along those of degree 1)."""
    degrees = par.degrees(world_size)
    coords, rest = {}, rank
    for name in reversed(DIMS):  # row-major: the last dimension varies fastest
        coords[name] = rest % degrees[name]
        rest //= degrees[name]
    return {name: coords[name] for name in DIMS}


def dp_index(par: ParallelismConfig, world_size: int, rank: int) -> int:
    """The rank's index along ``dp`` (which data it reads: the same for its tp, cp and pp
    peers)."""
    degrees, coords = par.degrees(world_size), coordinates(par, world_size, rank)
    return coords["dp_replicate"] * degrees["dp_shard"] + coords["dp_shard"]


def batch_rows(par: ParallelismConfig, world_size: int, batch_size: int) -> int:
    """Samples a rank's micro-batch holds: ``batch_size``, times ``pp_microbatches`` (default
    pp) under pipeline parallel, whose schedule cuts it into its micro-batches."""
    pp = par.degrees(world_size)["pp"]
    return batch_size * (par.pp_microbatches or pp) if pp > 1 else batch_size


def build_mesh(device_type: str, par: ParallelismConfig, world_size: int):
    """The job's DeviceMesh (see the module docstring), flattened dimensions included.

    Every rank calls it (it creates process groups). On fake, call it before the fake tensor
    mode is entered (the mesh's rank tensors must be real).
    """
    from torch.distributed.device_mesh import init_device_mesh


    if par.is_one_dim():
        return world_mesh(device_type, world_size)
    dims = mesh_dims(par, world_size)
    names = tuple(n for n, _ in dims)
    mesh = init_device_mesh(device_type, tuple(d for _, d in dims), mesh_dim_names=names)
    for flat, parts in FLATTENED.items():
        present = tuple(p for p in parts if p in names)
        if len(present) >= 2:
            mesh[present]._flatten(flat)
    if par.ep > 1:
        dims = expert_mesh_dims(par, world_size)
        mesh.expert_mesh = init_device_mesh(device_type, tuple(d for _, d in dims),
                                            mesh_dim_names=tuple(n for n, _ in dims))
    return mesh


def expert_mesh_dims(par: ParallelismConfig, world_size: int) -> list[tuple[str, int]]:
    """The expert mesh's dimensions (see the module docstring): pp and dp_replicate where
    present, then efsdp and ep (efsdp kept at degree 1: the experts' FSDP unit), then etp under
    tp."""
    degrees = par.degrees(world_size)
    region = degrees["dp_shard"] * degrees["cp"]
    if region % par.ep:
        raise ConfigError(f"workload.parallelism.ep={par.ep} must divide dp_shard x cp = "
                          f"{region} (expert parallel borrows those ranks)")
    outer = [(n, degrees[n]) for n in ("pp", "dp_replicate") if degrees[n] > 1]
    # under tp each expert's hidden units are split too (torchtitan's ep x etp, etp = tp):
    # an ep group is the ranks of one tp index
    inner = [("etp", degrees["tp"])] if degrees["tp"] > 1 else []
    return outer + [("efsdp", region // par.ep), ("ep", par.ep)] + inner


def ep_index(par: ParallelismConfig, world_size: int, rank: int) -> int:
    """The rank's index along ``ep`` (which experts it holds)."""
    degrees, coords = par.degrees(world_size), coordinates(par, world_size, rank)
    return (coords["dp_shard"] * degrees["cp"] + coords["cp"]) % par.ep


def sub_mesh(mesh, par: ParallelismConfig, world_size: int, *dims: str):
    """The (sub)mesh over those of ``dims`` (names of DIMS or FLATTENED) that are present, or
    None when none is: ``sub_mesh(mesh, par, w, "dp_replicate", "dp_shard_cp")`` is HSDP's
    2-D mesh, or FSDP's 1-D one without replicas."""
    if par.is_one_dim():
        return mesh if set(dims) & {"dp", "dp_shard", "dp_shard_cp", "dp_cp"} else None
    own = {n for n, _ in mesh_dims(par, world_size)}
    present = []
    for name in dims:
        if name in own:
            present.append(name)
        elif name in FLATTENED:
            parts = [p for p in FLATTENED[name] if p in own]
            if len(parts) >= 2:
                present.append(name)
            elif parts:
                present.append(parts[0])
    if not present:
        return None
    with warnings.catch_warnings():  # torch plans to drop slicing flattened dims off the root
        warnings.filterwarnings("ignore", message="Slicing a flattened dim")
        return mesh[present[0]] if len(present) == 1 else mesh[tuple(present)]


def validate_parallelism(cfg, world_size: int) -> None:
    """ConfigError when ``cfg.parallelism`` (a WorkloadConfig's) cannot split ``cfg``'s
    model over ``world_size`` ranks: the product, heads by tp, layers by pipeline stages,
    the sequence by cp, experts by ep, and what the recipe supports."""
    par = cfg.parallelism
    degrees = par.degrees(world_size)
    if par.is_one_dim():
        return
    where = f"workload.parallelism ({par.describe(world_size)})"
    if cfg.model == "custom":
        return  # the step parallelizes itself over ctx.mesh
    if cfg.parallel != "fsdp2":
        raise ConfigError(f"{where} needs workload.parallel=fsdp2 (got {cfg.parallel}): the "
                          "mesh recipes shard the data-parallel dimensions with FSDP2, as "
                          "torchtitan does")
    sizes = {**degrees, "ep": par.ep}  # ep splits experts within the other degrees' ranks
    unbuilt = [f"{name}={sizes[name]}" for name in ("dp_replicate", "tp", "pp", "cp", "ep")
               if sizes[name] > 1 and name not in model_spec(cfg.model).mesh_dims]
    if unbuilt:
        raise ConfigError(f"{where}: {' '.join(unbuilt)} is not built for workload.model="
                          f"{cfg.model} (actors/capture/workloads/models/{cfg.model}/)")
    tp, cp, pp = degrees["tp"], degrees["cp"], degrees["pp"]
    split = [f"{name}={degrees[name]}" for name in ("tp", "pp") if degrees[name] > 1]
    if split and cfg.tie_embeddings:
        raise ConfigError(f"{where}: workload.tie_embeddings=true with {' '.join(split)}: the "
                          "plans part the embedding and the output (tp: two parallel styles, pp: the "
                          "first and the last stage); untie them")
    if split and cfg.loss_chunks > 1:
        raise ConfigError(f"{where}: workload.loss_chunks={cfg.loss_chunks} with "
                          f"{' '.join(split)}: tp computes the loss on vocabulary-sharded "
                          "logits (loss parallel) and pp in the last stage's schedule; use "
                          "loss_chunks=1 there")
    if degrees["dp_replicate"] * degrees["dp_shard"] * cp == 1:
        _validate_unsharded(cfg, where)
    kv_heads = cfg.n_kv_heads or cfg.n_heads
    if cfg.n_heads % tp or kv_heads % tp:
        raise ConfigError(f"{where}: workload.n_heads={cfg.n_heads} and n_kv_heads={kv_heads} "
                          f"must be divisible by tp={tp} (each rank holds whole heads)")
    ffn = cfg.ffn_dim or 0
    if ffn and ffn % tp:
        raise ConfigError(f"{where}: workload.ffn_dim={ffn} is not divisible by tp={tp}")
    if cfg.vocab % tp:
        raise ConfigError(f"{where}: workload.vocab={cfg.vocab} is not divisible by tp={tp} "
                          "(the embedding and output are split by vocabulary rows)")
    # torchtitan's rule: the sequence splits into tp (sequence parallel) x 2 cp (ring
    # attention's load balancing takes two chunks per rank) equal parts.
    divisor = tp * (2 * cp if cp > 1 else 1)
    if cfg.seq_len % divisor:
        raise ConfigError(f"{where}: workload.seq_len={cfg.seq_len} must be divisible by "
                          f"tp x 2 cp = {divisor} (sequence parallel, then ring attention's "
                          "two chunks per context-parallel rank)")
    if cp > 1:
        _validate_ring_chunks(cfg, cp, where)
    _validate_experts(cfg, par, world_size, where)
    if cfg.float8 and tp > 1:
        raise ConfigError(f"{where}: workload.float8 with tp={tp} needs torchao's float8 "
                          "parallel styles (Float8ColwiseParallel, ...): not built; float8 "
                          "runs with FSDP2, HSDP, cp and pp")
    _validate_pipeline(cfg, par, pp, where)


def _validate_ring_chunks(cfg, cp: int, where: str) -> None:
    """On meta and fake (a GPU's kernels), ring attention with CUDA's memory-efficient kernel
    (float32, or a family's narrower values: ModelSpec.narrower_values) needs chunks of whole
    32-row blocks: the kernel pads its logsumexp to a multiple of 32 rows and torch's ring
    merges it with the unpadded output (a broadcast error deep in torch otherwise, on a GPU
    too)."""
    narrower = model_spec(cfg.model).narrower_values(cfg)
    efficient = cfg.precision == "fp32" or narrower
    half_chunk = cfg.seq_len // (2 * cp)
    if str(cfg.device) in ("meta", "fake") and efficient and half_chunk % 32:
        kernel = "MLA's narrower values" if narrower else "float32"
        raise ConfigError(f"{where}: workload.seq_len={cfg.seq_len} gives ring attention "
                          f"chunks of seq_len / 2 cp = {half_chunk} rows; with {kernel} it "
                          "runs CUDA's memory-efficient kernel, whose logsumexp torch's ring "
                          "merges in blocks of 32 rows: use a seq_len divisible by "
                          f"{2 * cp * 32}")


def _validate_unsharded(cfg, where: str) -> None:
    """No data-parallel ranks (only tp, pp): torchtitan applies no FSDP there, so the FSDP2
    knobs have nothing to act on, and it trains such a job in float32 (mixed precision is
    FSDP's ``MixedPrecisionPolicy``): refused rather than predicted as another job."""
    fsdp_knobs = {"precision": cfg.precision == "bf16_mixed", "cpu_offload": cfg.cpu_offload,
                  "reshard_after_forward": cfg.reshard_after_forward != "default",
                  "optimizer_in_backward": cfg.optimizer_in_backward}
    fsdp_only = [f"{name}={getattr(cfg, name)}" for name, is_set in fsdp_knobs.items() if is_set]
    if fsdp_only:
        raise ConfigError(f"{where}: no rank is left for dp_shard x cp, so no FSDP2 shards "
                          f"the parameters (as torchtitan), and workload.{', '.join(fsdp_only)} "
                          "is FSDP2's; use precision fp32 or bf16 and FSDP2's defaults, or "
                          "leave at least 2 ranks for dp_shard")


def _validate_experts(cfg, par: ParallelismConfig, world_size: int, where: str) -> None:
    """The MoE block on the mesh: ep splits its experts, tp their hidden units (expert tensor
    parallel), both together as torchtitan's ep x etp; pp with ep is not built."""
    degrees, experts = par.degrees(world_size), cfg.moe_experts
    tp = degrees["tp"]
    if experts and tp > 1:
        hidden = expert_ffn_dim(cfg)
        if hidden % tp:
            raise ConfigError(f"{where}: the experts' hidden size {hidden} (workload."
                              f"moe_ffn_dim) is not divisible by tp={tp} (each rank runs "
                              "hidden / tp units of every expert)")
    if par.ep == 1:
        return
    if not experts:
        raise ConfigError(f"{where}: expert parallel splits an MoE block's experts; set "
                          "workload.moe_experts (0: a dense model)")
    if experts % par.ep:
        raise ConfigError(f"{where}: workload.moe_experts={experts} is not divisible by "
                          f"ep={par.ep} (each rank holds moe_experts / ep experts)")
    if degrees["pp"] > 1:
        raise ConfigError(f"{where}: expert parallel under pipeline parallel is not built")
    expert_mesh_dims(par, world_size)  # ep divides dp_shard x cp


def _validate_pipeline(cfg, par: ParallelismConfig, pp: int, where: str) -> None:
    if pp == 1:
        if par.pp_stages_per_rank != 1 or par.pp_microbatches:
            raise ConfigError(f"{where}: pp_stages_per_rank and pp_microbatches need pp > 1")
        return
    stages = pp * par.pp_stages_per_rank
    if par.pp_stages_per_rank < 1 or par.pp_microbatches < 0:
        raise ConfigError(f"{where}: pp_stages_per_rank={par.pp_stages_per_rank} must be >= 1 "
                          f"and pp_microbatches={par.pp_microbatches} >= 0")
    if cfg.n_layers + 2 < stages:
        raise ConfigError(f"{where}: workload.n_layers={cfg.n_layers} blocks (+ the embedding "
                          f"and the output) cannot fill {stages} pipeline stages "
                          "(pp x pp_stages_per_rank)")
    interleaved = par.pp_schedule == PipelineSchedule.interleaved_1f1b
    if interleaved != (par.pp_stages_per_rank > 1):
        raise ConfigError(f"{where}: pp_schedule={par.pp_schedule} with pp_stages_per_rank="
                          f"{par.pp_stages_per_rank}: interleaved_1f1b runs 2 or more stages per "
                          "rank, gpipe and 1f1b one")
    n_mb = par.pp_microbatches or pp
    if par.pp_schedule != PipelineSchedule.gpipe and n_mb < pp:
        raise ConfigError(f"{where}: pp_microbatches={n_mb} < pp={pp}: {par.pp_schedule} needs "
                          "a micro-batch in flight per stage")
    if cfg.grad_accum_steps != 1:
        raise ConfigError(f"{where}: grad_accum_steps={cfg.grad_accum_steps} under pp: the "
                          "schedule's micro-batches accumulate; use pp_microbatches")


def rank_roles(par: ParallelismConfig, world_size: int,
               skewed_experts: bool = False) -> dict[str, list[int]]:
    """``{role: its ranks}``, in rank order; ranks of one role run the same program on the
    same shapes, only on other process groups (the first is the one a fake capture records).

    A role is the pipeline stage and, under context parallel, the cp rank: ring attention's
    load balancing gives each cp rank other query / key chunks in each ring step. With
    ``skewed_experts`` (an MoE routing assumption with a hot expert), the ep rank too: each
    holds other experts, hence receives other token counts. Ranks that differ only along
    dp_replicate, dp_shard or tp are alike.
    """
    roles: dict[str, list[int]] = {}
    degrees = par.degrees(world_size)
    for rank in range(world_size):
        c = coordinates(par, world_size, rank)
        parts = ([f"pp stage {c['pp']}"] if degrees["pp"] > 1 else []) \
            + ([f"cp rank {c['cp']}"] if degrees["cp"] > 1 else []) \
            + ([f"ep rank {ep_index(par, world_size, rank)}"]
               if skewed_experts and par.ep > 1 else [])
        roles.setdefault(", ".join(parts) or "every rank", []).append(rank)
    return roles
