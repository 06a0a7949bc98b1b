"""The CUDA device a replay predicts memory for (``target=h100_80gb``): its memory, what no
tensor shows (the CUDA context, NCCL's buffers, cuBLAS workspaces) and the caching
allocator's knobs.

Every figure is a documented default or mechanism, named in the run's output, never fitted
to a published run; override any of them (``target.cuda_context=600MiB``):

* ``device_memory``: the product's nominal capacity. The driver shows a little less
  (``torch.cuda.get_device_properties(0).total_memory``); set that for an exact figure.
* ``cuda_context``: 512 MiB, a default for a CUDA 12 context with lazy module loading
  (PyTorch's default, ``CUDA_MODULE_LOADING=LAZY``). It depends on the driver, the CUDA
  version and the kernels loaded; measure yours as ``total - free`` of
  ``torch.cuda.mem_get_info()`` minus ``torch.cuda.memory_reserved()`` after a first matmul.
* NCCL: ``NCCL_BUFFSIZE`` (default 4 MiB) per channel and per peer connection, with
  ``NCCL_NCHANNELS_PER_NET_PEER`` (default 2) channels and 2 peers (a ring's previous and
  next rank). NCCL allocates them itself, outside PyTorch's allocator.
* cuBLAS workspace: ``CUBLAS_WORKSPACE_CONFIG`` (``:SIZE_KiB:COUNT`` pairs); PyTorch's
  default is ``:4096:2:16:8`` (8 MiB + 128 KiB), ``:4096:8`` (32 MiB) on Hopper. PyTorch
  allocates it through its caching allocator, so the model serves it as the first request
  (it counts in reserved memory) instead of taking it off the capacity.

``usable_capacity_bytes`` = device memory - context - NCCL buffers: what the caching
allocator may reserve.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from actors.choices import Choice
from actors.config_fields import setting
from actors.errors import ConfigError
from actors.gpu_arch import GpuArch
from actors.replay.config import parse_bytes
from actors.replay.memory.cuda_alloc_conf import AllocatorSettings, parse_alloc_conf
from actors.trace.categories import CATEGORIES


class TargetName(Choice):
    """The device a replay predicts reserved memory for."""

    none = "none"  # no allocator model (the replay's accounted and measured figures only)
    a100_40gb = "a100_40gb"
    a100_80gb = "a100_80gb"
    h100_80gb = "h100_80gb"
    h100_96gb = "h100_96gb"
    h200_141gb = "h200_141gb"
    custom = "custom"  # set target.device_memory


@dataclass
class CudaAllocatorConfig:
    """The caching allocator's knobs, as ``PYTORCH_CUDA_ALLOC_CONF`` sets them."""

    pytorch_cuda_alloc_conf: str = setting("", help=(
        "The whole string, e.g. \"max_split_size_mb:128,expandable_segments:True\"; the fields "
        "below, when set, override its options."))
    max_split_size_mb: int | None = setting(None, help=(
        "Blocks at least this big (MiB, > 20) are never split; null: unlimited (the default)."))
    expandable_segments: bool | None = setting(None, help=(
        "One growing segment per pool mapped in pages; null: as the string says (default off)."))
    garbage_collection_threshold: float | None = setting(None, help=(
        "Fraction of the capacity above which long-unused cached segments are released before a "
        "new one is reserved (PyTorch applies it only with a per-process memory fraction set)."))
    roundup_power2_divisions: int | None = setting(None, help=(
        "Round requests to one of N steps between powers of two (a power of 2); null: 512 B."))

    def settings(self) -> AllocatorSettings:
        """The string's options with the explicit fields applied over them."""
        key = "target.allocator.pytorch_cuda_alloc_conf"
        extra = [f"{name}:{value}" for name, value in (
            ("max_split_size_mb", self.max_split_size_mb),
            ("expandable_segments", self.expandable_segments),
            ("garbage_collection_threshold", self.garbage_collection_threshold),
            ("roundup_power2_divisions", self.roundup_power2_divisions)) if value is not None]
        text = ",".join(p for p in (self.pytorch_cuda_alloc_conf, *extra) if p)
        return parse_alloc_conf(text, key if not extra else "target.allocator")


_NOMINAL = {TargetName.a100_40gb: "40GiB", TargetName.a100_80gb: "80GiB",
            TargetName.h100_80gb: "80GiB", TargetName.h100_96gb: "96GiB",
            TargetName.h200_141gb: "141GiB"}
_ARCH = {TargetName.a100_40gb: GpuArch.sm80, TargetName.a100_80gb: GpuArch.sm80,
         TargetName.h100_80gb: GpuArch.sm90, TargetName.h100_96gb: GpuArch.sm90,
         TargetName.h200_141gb: GpuArch.sm90}
# PyTorch's default CUBLAS_WORKSPACE_CONFIG (aten/src/ATen/cuda/CublasHandlePool.cpp):
# 32 MiB on Hopper, 4096 KiB x 2 + 16 KiB x 8 before it (and for a custom target).
_HOPPER = (TargetName.h100_80gb, TargetName.h100_96gb, TargetName.h200_141gb)
_WORKSPACE_DEFAULT, _WORKSPACE_HOPPER = ":4096:2:16:8", ":4096:8"


@dataclass
class TargetConfig:
    """A CUDA device to predict reserved memory for; ``none`` turns the model off."""

    name: TargetName = setting(TargetName.none, help=(
        "none, a100_40gb, a100_80gb, h100_80gb, h100_96gb, h200_141gb or custom."))
    arch: GpuArch | None = setting(None, help=(
        "The GPU's architecture (sm80, sm86, sm89, sm90, sm100, sm120): a capture for this "
        "target runs its kernels where the CPU's allocate otherwise (attention); null: the "
        "named product's (a100: sm80; h100, h200: sm90), sm90 for custom."))
    device_memory: str | None = setting(None, help=(
        "The device's memory (\"80GiB\" or bytes); null: the named product's nominal capacity."))
    cuda_context: str = setting("512MiB", help=(
        "Memory of the CUDA context (driver, loaded kernels): a default, measure yours."))
    nccl_buffsize: str = setting("4MiB", help=(
        "NCCL_BUFFSIZE: NCCL's buffer per channel and peer (NCCL's default 4 MiB)."))
    nccl_channels_per_peer: int = setting(2, help=(
        "Channels per peer (NCCL_NCHANNELS_PER_NET_PEER's default 2)."))
    nccl_num_peers: int = setting(2, help=(
        "Peers with NCCL connections (a ring: 2); 0 for a single-GPU job."))
    cublas_workspace_config: str | None = setting(None, help=(
        "CUBLAS_WORKSPACE_CONFIG: \":SIZE_KiB:COUNT\" pairs; null: PyTorch's default for the "
        "target (\":4096:8\" on Hopper, \":4096:2:16:8\" otherwise)."))
    allocator: CudaAllocatorConfig = setting(factory=CudaAllocatorConfig, help=(
        "The caching allocator's settings (PYTORCH_CUDA_ALLOC_CONF; docs/prediction.md)."))
    host_categories: list[str] = setting(factory=list, help=(
        "Storage categories (actors/trace/categories.py) the job keeps in host memory, not the "
        "device's: FSDP2's CPUOffloadPolicy keeps parameters, gradients and optimizer state "
        "there (tracefleet-predict sets them from workload.cpu_offload). The allocator model "
        "serves the rest; their bytes are reported as host_peak_bytes."))

    def __post_init__(self):
        self.name = TargetName.coerce(self.name, "target.name")
        if self.arch is not None:
            self.arch = GpuArch.coerce(self.arch, "target.arch")

    @property
    def enabled(self) -> bool:
        return self.name != TargetName.none

    @property
    def gpu_arch(self) -> GpuArch | None:
        """The architecture whose kernels a capture for this target runs (None: no target)."""
        if not self.enabled:
            return None
        return self.arch or _ARCH.get(self.name, GpuArch.sm90)

    def validate(self) -> None:
        """ConfigError on a value out of its domain (before any cluster work)."""
        if not self.enabled:
            return

        unknown = sorted(set(self.host_categories) - set(CATEGORIES))
        if unknown:
            raise ConfigError(f"target.host_categories: {unknown} are not storage categories "
                              f"({', '.join(CATEGORIES)})")
        self.figures()
        self.allocator.settings()

    def figures(self) -> dict:
        """The device's memory, each part no tensor shows (with where its value comes from)
        and the usable capacity, in bytes."""
        if self.device_memory is None and self.name not in _NOMINAL:
            raise ConfigError("target=custom needs target.device_memory (e.g. 100GiB)")
        device = parse_bytes(self.device_memory or _NOMINAL[self.name], "target.device_memory")
        context = parse_bytes(self.cuda_context, "target.cuda_context")
        buffsize = parse_bytes(self.nccl_buffsize, "target.nccl_buffsize")
        if min(self.nccl_channels_per_peer, self.nccl_num_peers, context, buffsize) < 0:
            raise ConfigError("target: NCCL counts and sizes must not be negative")
        nccl = buffsize * self.nccl_channels_per_peer * self.nccl_num_peers
        workspace = self.cublas_workspace_config or \
            (_WORKSPACE_HOPPER if self.name in _HOPPER else _WORKSPACE_DEFAULT)
        origin = "" if self.cublas_workspace_config else " (PyTorch's default)"
        usable = device - context - nccl
        if usable <= 0:
            raise ConfigError(f"target {self.name}: the context ({context} B) and NCCL buffers "
                              f"({nccl} B) leave nothing of the device's {device} B")
        return {
            "name": str(self.name), "device_memory_bytes": device,
            "cuda_context_bytes": context, "nccl_buffer_bytes": nccl,
            "cublas_workspace_bytes": cublas_workspace_bytes(workspace),
            "usable_capacity_bytes": usable,
            "defaults": {
                "device_memory": self.device_memory or f"{_NOMINAL[self.name]} (nominal)",
                "cuda_context": f"{self.cuda_context} (default for a CUDA 12 lazy-loading "
                                "context; measure yours)",
                "nccl": f"NCCL_BUFFSIZE {self.nccl_buffsize} x {self.nccl_channels_per_peer} "
                        f"channels/peer x {self.nccl_num_peers} peers",
                "cublas_workspace": f"CUBLAS_WORKSPACE_CONFIG {workspace}{origin}, served by "
                                    "the caching allocator: in reserved",
                "kernels": f"{self.gpu_arch}" + ("" if self.arch else
                                                 " (the named GPU's; target.arch)")},
        }


def cublas_workspace_bytes(config: str) -> int:
    """Bytes of a ``CUBLAS_WORKSPACE_CONFIG`` value (``:4096:8`` = 4096 KiB x 8)."""
    text = config.strip()
    if not re.fullmatch(r"(:[0-9]+:[0-9]+)+", text):
        raise ConfigError(f"target.cublas_workspace_config={config!r}; expected :SIZE_KiB:COUNT "
                          "pairs, e.g. :4096:8")
    sizes = [int(n) for n in text.split(":")[1:]]
    return sum(kib * count * 1024 for kib, count in zip(sizes[::2], sizes[1::2]))
