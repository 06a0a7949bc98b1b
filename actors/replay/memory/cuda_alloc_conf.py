"""The CUDA caching allocator's settings (``PYTORCH_CUDA_ALLOC_CONF``) and its size rules.

The constants and rules follow PyTorch's ``c10/cuda/CUDACachingAllocator.cpp`` and
``CUDAAllocatorConfig``, re-implemented from their documented behaviour (no torch needed):

* every request is rounded up to a multiple of 512 B (``kMinBlockSize``), or, with
  ``roundup_power2_divisions``, to the next of N equal steps between two powers of two;
* requests up to 1 MiB (``kSmallSize``) come from the small pool, carved from 2 MiB segments
  (``kSmallBuffer``); larger ones from the large pool, in 20 MiB segments (``kLargeBuffer``)
  below 10 MiB (``kMinLargeAlloc``) and in segments rounded up to 2 MiB (``kRoundLarge``) above.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from actors.errors import ConfigError

MiB = 1 << 20
MIN_BLOCK = 512  # kMinBlockSize: every block is a multiple of this
SMALL_SIZE = MiB  # kSmallSize: the largest request served by the small pool
SMALL_BUFFER = 2 * MiB  # kSmallBuffer: a small-pool segment; also its expandable page
MIN_LARGE_ALLOC = 10 * MiB  # kMinLargeAlloc: below it a large request gets a 20 MiB segment
LARGE_BUFFER = 20 * MiB  # kLargeBuffer: that segment; also the large pool's expandable page
ROUND_LARGE = 2 * MiB  # kRoundLarge: larger segments are rounded up to this
NUM_DIVISION_INTERVALS = 16  # roundup_power2_divisions: one value per power of two, 1 MiB..64 GiB

# Options PyTorch accepts that do not change which blocks exist (pinned host memory, locking).
_IGNORED = ("release_lock_on_cudamalloc", "pinned_use_cuda_host_register",
            "pinned_num_register_threads", "pinned_use_background_threads",
            "pinned_reserve_segment_size_mb", "graph_capture_record_stream_reuse")


@dataclass
class AllocatorSettings:
    """The knobs of the caching allocator that decide reserved memory."""

    # Blocks at least this big are never split and a smaller request never takes one;
    # None: unlimited (PyTorch's default).
    max_split_size_bytes: int | None = None
    # One growing segment per pool, mapped in pages (2 MiB small, 20 MiB large).
    expandable_segments: bool = False
    # Per power-of-two interval (1 MiB, 2 MiB, ... 32 GiB and above): round a request up to
    # one of this many equal steps; 0 or 1: plain 512 B rounding.
    roundup_power2_divisions: list[int] = field(
        default_factory=lambda: [0] * NUM_DIVISION_INTERVALS)
    # Fraction of the capacity above which cached blocks unused for longest are released
    # before a new segment is reserved; None: off.
    garbage_collection_threshold: float | None = None


def parse_alloc_conf(text: str | None, key: str = "PYTORCH_CUDA_ALLOC_CONF") -> AllocatorSettings:
    """Parse ``max_split_size_mb:128,expandable_segments:True,...`` (PyTorch's format);
    ConfigError naming ``key`` on anything PyTorch would refuse or this model cannot follow."""
    settings = AllocatorSettings()
    for option, value in _options(text or "", key):
        if option == "max_split_size_mb":
            mb = _int(value, key, option)
            if mb <= LARGE_BUFFER // MiB:  # PyTorch's own check
                raise ConfigError(f"{key}: max_split_size_mb={mb}; must be > {LARGE_BUFFER // MiB}")
            settings.max_split_size_bytes = mb * MiB
        elif option == "expandable_segments":
            if value not in ("True", "False"):
                raise ConfigError(f"{key}: expandable_segments={value!r}; expected True or False")
            settings.expandable_segments = value == "True"
        elif option == "garbage_collection_threshold":
            try:
                fraction = float(value)
            except ValueError:
                fraction = -1.0
            if not 0 < fraction < 1:
                raise ConfigError(f"{key}: garbage_collection_threshold={value!r}; "
                                  "expected a fraction in (0, 1)")
            settings.garbage_collection_threshold = fraction
        elif option == "roundup_power2_divisions":
            settings.roundup_power2_divisions = _divisions(value, key)
        elif option == "backend":
            if value != "native":
                raise ConfigError(f"{key}: backend={value!r}; only the native caching allocator "
                                  "is modelled (cudaMallocAsync is not)")
        elif option not in _IGNORED:
            raise ConfigError(f"{key}: unknown option {option!r}")
    return settings


def _options(text: str, key: str):
    """(option, value) pairs; a list value ``[a:b,c:d]`` stays one value."""
    depth, start, parts = 0, 0, []
    for i, ch in enumerate(text):
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    for part in (p.strip() for p in parts):
        if not part:
            continue
        option, sep, value = part.partition(":")
        if not sep or not value.strip():
            raise ConfigError(f"{key}: {part!r}; expected option:value")
        yield option.strip(), value.strip()


def _int(value: str, key: str, option: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{key}: {option}={value!r}; expected an integer") from None


def _is_power2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _divisions(value: str, key: str) -> list[int]:
    """``4`` (every interval) or ``[256:1,512:2,>:8]`` (interval start in MiB: divisions; the
    first entry also covers the intervals below it, ``>`` those after the last one)."""
    option = "roundup_power2_divisions"
    if not value.startswith("["):
        n = _int(value, key, option)
        if not _is_power2(n):
            raise ConfigError(f"{key}: {option}={n}; expected a power of 2")
        return [n] * NUM_DIVISION_INTERVALS
    if not value.endswith("]"):
        raise ConfigError(f"{key}: {option}={value!r}; expected [MiB:divisions,...]")
    out = [0] * NUM_DIVISION_INTERVALS
    last = None
    for entry in filter(None, (e.strip() for e in value[1:-1].split(","))):
        start, _, n_text = entry.partition(":")
        n = _int(n_text, key, option)
        if n and not _is_power2(n):
            raise ConfigError(f"{key}: {option} entry {entry!r}; divisions must be a power of 2")
        if start.strip() == ">":
            first = 0 if last is None else last + 1
            out[first:] = [n] * (NUM_DIVISION_INTERVALS - first)
            continue
        mib = _int(start, key, option)
        if not _is_power2(mib):
            raise ConfigError(f"{key}: {option} entry {entry!r}; the interval must be a power of 2")
        index = min(mib.bit_length() - 1, NUM_DIVISION_INTERVALS - 1)
        if last is None:
            out[:index] = [n] * index
        out[index] = n
        last = index
    return out


def round_size(nbytes: int, divisions: list[int]) -> int:
    """The block size the allocator serves a request of ``nbytes`` with."""
    if nbytes < MIN_BLOCK:
        return MIN_BLOCK
    n = divisions[min(max(nbytes.bit_length() - 1 - 20, 0), NUM_DIVISION_INTERVALS - 1)]
    if n > 1 and nbytes > MIN_BLOCK * n:
        if nbytes & (nbytes - 1) == 0:
            return nbytes
        floor = 1 << (nbytes.bit_length() - 1)
        step = floor >> (n.bit_length() - 1)
        if step == 0:
            return floor << 1
        rounded = nbytes & ~(step - 1)
        return nbytes if rounded == nbytes else rounded + step
    return -(-nbytes // MIN_BLOCK) * MIN_BLOCK


def segment_size(size: int) -> int:
    """The segment reserved for a (rounded) request no cached block can serve."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE
