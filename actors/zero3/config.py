"""ZeRO-3 emulation settings (the ``zero3`` config group; one YAML per strategy in conf/zero3/)."""
from __future__ import annotations

from dataclasses import dataclass

from actors.choices import Choice
from actors.config_fields import setting
from actors.errors import ConfigError


class Zero3Strategy(Choice):
    """How partitioned parameters are fetched before use and released after it."""

    none = "none"  # replay the trace's own collectives as recorded (no emulation)
    per_param = "per_param"  # one all-gather per parameter, per-parameter wait and release
    per_module = "per_module"  # one all-gather per module, per-parameter bookkeeping (DeepSpeed)
    leaf_coalesced = "leaf_coalesced"  # a leaf module's subtree: one flat buffer, one gather, bulk free
    bucketed = "bucketed"  # parameters in execution order, buckets of prefetch_bucket_size elements


class ParamRef(Choice):
    """How ``zero3.modules`` names a parameter."""

    tensor_id = "tensor_id"  # the trace's tensor id (first field of a tensor tuple)
    order = "order"  # position among the detected parameters in order of first use, from 0


class StatesLayout(Choice):
    """Which model states a rank holds beside its parameter shards."""

    deepspeed = "deepspeed"  # DeepSpeed stage 3's: fp32 masters and moments, gradient
    # partitions and reduce bucket buffers (actors/zero3/deepspeed_layout.py)
    trace = "trace"  # only the trace's own optimizer state and gradients, partitioned


class OffloadDevice(Choice):
    """Where DeepSpeed keeps an offloaded part (its ``offload_*.device``; nvme is not built)."""

    none = "none"  # on the accelerator
    cpu = "cpu"  # in host memory


@dataclass
class OffloadConfig:
    """DeepSpeed's ``offload_optimizer`` / ``offload_param`` section (its device)."""

    device: OffloadDevice = setting(OffloadDevice.none, help=(
        "none: on the accelerator; cpu: in host memory (DeepSpeed's offload_*.device)."))

    def __post_init__(self):
        self.device = OffloadDevice.coerce(self.device, "zero3.offload_*.device")

    @property
    def enabled(self) -> bool:
        return self.device != OffloadDevice.none


class GradAccumDtype(Choice):
    """DeepSpeed's ``data_types.grad_accum_dtype``."""

    param = "param"  # the parameters' dtype (DeepSpeed's default)
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


@dataclass
class Zero3Config:
    """ZeRO-3 parameter partitioning and fetch/release emulation."""

    strategy: Zero3Strategy = setting(Zero3Strategy.none, help=(
        "none replays the trace's own collectives as recorded; the other strategies partition "
        "the trace's parameters (a flat 1/world shard each, padded as DeepSpeed pads) and "
        "all-gather them around their uses: per_param, per_module, leaf_coalesced or bucketed. "
        "Their gradients and optimizer state are partitioned too (reduce_bucket_size), as in "
        "ZeRO-3."))
    param_persistence_threshold: int = setting(100_000, help=(
        "Parameters with at most this many elements stay gathered on every rank (DeepSpeed's "
        "stage3_param_persistence_threshold, default 1e5). 0 partitions every parameter."))
    leaf_modules: list[str] = setting(factory=list, help=(
        "leaf_coalesced: module qualified-name patterns (fnmatch, e.g. ['blocks.*', "
        "'*.experts']) fetched as one unit with their whole subtree. Names come from the "
        "trace's module ranges or from zero3.modules."))
    module_granularity_threshold: int = setting(0, help=(
        "leaf_coalesced: DeepSpeed's rule instead of (or besides) patterns: a module whose "
        "parameter elements per layer (subtree params / (torch leaf layers + 1)) are at most "
        "this becomes a leaf, parents first. 0 disables the rule."))
    modules: dict[str, list[int]] = setting(factory=dict, help=(
        "Parameters of modules the trace does not delimit (no module ranges), as {module "
        "qualname: [parameter, ...]}; each parameter by zero3.modules_by. The modules are "
        "fetched as units around the uses of their parameters and can be leaf_modules. On the "
        "command line: '+zero3.modules={blocks.0:[0,1,2],head:[3]}'."))
    modules_by: ParamRef = setting(ParamRef.tensor_id, help=(
        "How zero3.modules names parameters: tensor_id (the trace's tensor ids) or order "
        "(0-based position among detected parameters, in order of first use)."))
    prefetch: bool = setting(False, help=(
        "Issue the next fetches' all-gathers asynchronously right after the current fetch "
        "completes (up to prefetch_bucket_size elements ahead, within max_live_parameters)."))
    prefetch_bucket_size: int = setting(50_000_000, help=(
        "Elements: the bucket size of strategy=bucketed and the look-ahead of prefetch "
        "(DeepSpeed's stage3_prefetch_bucket_size, default 5e7)."))
    max_live_parameters: int = setting(1_000_000_000, help=(
        "Elements gathered at once beyond which prefetch waits (DeepSpeed's "
        "stage3_max_live_parameters, default 1e9)."))
    world_size: int | None = setting(None, help=(
        "Emulate rank r of an N-rank ZeRO-3 job on one actor (replay.mode=compute only): shards "
        "are 1/N, all-gathers are allocations of the gathered size with no communication. null: "
        "the real world size."))
    hpz_partition_size: int = setting(1, help=(
        "ZeRO++ hierarchical partitioning (hpZ): ranks per secondary group, normally the ranks "
        "per node (tracefleet orders ranks by node, so groups of consecutive ranks are nodes). "
        "The forward release keeps a 1/hpz_partition_size copy of each unit on every rank, and "
        "backward all-gathers run within the group from those copies; they are dropped before "
        "the update. 1 is off. Must divide the world size."))
    reduce_bucket_size: int = setting(500_000_000, help=(
        "Elements: gradients of partitioned parameters wait full-size in a bucket of at most "
        "this many elements (one per dtype) until its reduce-scatter leaves each rank its "
        "1/world shard (DeepSpeed's reduce_bucket_size, default 5e8). A gradient that would "
        "overflow the bucket sends it first; a bucket is also sent before its gradients are "
        "used again."))
    layout: StatesLayout = setting(StatesLayout.deepspeed, help=(
        "deepspeed: hold the model states as DeepSpeed's stage 3 does (an fp32 master "
        "partition, fp32 optimizer moments, one persistent buffer of gradient partitions, a "
        "reduce bucket buffer, the update's flattened fp32 gradients), so a plain trace "
        "emulates a DeepSpeed job; trace: only what the trace's optimizer holds, partitioned."))
    grad_accum_dtype: GradAccumDtype = setting(GradAccumDtype.param, help=(
        "layout=deepspeed: dtype of the gradient partitions (DeepSpeed's "
        "data_types.grad_accum_dtype; param = the parameters' dtype, its default)."))
    offload_optimizer: OffloadConfig = setting(factory=OffloadConfig, help=(
        "DeepSpeed's offload_optimizer (ZeRO-Offload): device cpu keeps the optimizer's part in "
        "host memory (the fp32 master partition, the moments, the gradient partitions and their "
        "fp32 copy; the update runs there), so the device holds the parameter partition, the "
        "reduce bucket and the gradients until they are reduced. Host bytes are reported apart."))
    offload_param: OffloadConfig = setting(factory=OffloadConfig, help=(
        "DeepSpeed's offload_param (ZeRO-Infinity): device cpu keeps the parameter partitions "
        "in host memory; each fetch copies this rank's partition to the device for the "
        "all-gather."))

    def __post_init__(self):
        for name in ("offload_optimizer", "offload_param"):
            section = getattr(self, name)
            if isinstance(section, dict):  # rebuilt from asdict (meta.json, ranks)
                setattr(self, name, OffloadConfig(**section))
        self.strategy = Zero3Strategy.coerce(self.strategy, "zero3.strategy")
        self.modules_by = ParamRef.coerce(self.modules_by, "zero3.modules_by")
        self.layout = StatesLayout.coerce(self.layout, "zero3.layout")
        self.grad_accum_dtype = GradAccumDtype.coerce(self.grad_accum_dtype,
                                                      "zero3.grad_accum_dtype")

    @property
    def enabled(self) -> bool:
        """True when a strategy other than ``none`` is chosen."""
        return self.strategy != Zero3Strategy.none

    def validate(self, replay_mode: str) -> None:
        """Raise ConfigError on values outside their domain or inconsistent with ``replay.mode``."""
        for key in ("param_persistence_threshold", "module_granularity_threshold"):
            if getattr(self, key) < 0:
                raise ConfigError(f"zero3.{key}={getattr(self, key)}; expected >= 0")
        for key in ("prefetch_bucket_size", "max_live_parameters", "hpz_partition_size",
                    "reduce_bucket_size"):
            if getattr(self, key) < 1:
                raise ConfigError(f"zero3.{key}={getattr(self, key)}; expected >= 1")
        if self.world_size is not None:
            if self.world_size < 1:
                raise ConfigError(f"zero3.world_size={self.world_size}; expected >= 1")
            if self.enabled and replay_mode != "compute":
                raise ConfigError(f"zero3.world_size={self.world_size} emulates the job without "
                                  f"communication: set replay.mode=compute (got {replay_mode})")
        for name, refs in (self.modules or {}).items():
            if not refs or not all(isinstance(r, int) and r >= 0 for r in refs):
                raise ConfigError(f"zero3.modules[{name!r}]={refs!r}; expected a non-empty list "
                                  f"of parameter {self.modules_by.value}s (integers >= 0)")
