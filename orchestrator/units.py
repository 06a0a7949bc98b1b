"""Numbers and names for people: binary byte units and one-line names, shared by the reports and
tracefleet-inspect."""
from __future__ import annotations

_BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def byte_unit(num_bytes: float) -> tuple[int, str]:
    """The largest binary unit (divisor, name) that keeps ``num_bytes`` at 1 or more."""
    power = 0
    while power < len(_BYTE_UNITS) - 1 and abs(num_bytes) >= 1024 ** (power + 1):
        power += 1
    return 1024 ** power, _BYTE_UNITS[power]


def human_bytes(num_bytes: float | None) -> str:
    """``1536`` -> ``"1.5 KiB"`` (binary units); ``None`` -> ``"-"``."""
    if num_bytes is None:
        return "-"
    scale, unit = byte_unit(num_bytes)
    return f"{num_bytes:.0f} B" if scale == 1 else f"{num_bytes / scale:.1f} {unit}"


MAX_NAME_CHARS = 160  # a name from a file (an op, a frame) as printed: one readable line


def one_line(text: str, limit: int = MAX_NAME_CHARS) -> str:
    """``text`` cut to ``limit`` characters with its length said (a name of 20 MiB from a
    trace is printed as one short line, not whole)."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"
