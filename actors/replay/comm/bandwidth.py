"""Collective size math: buffer sizes, message bytes, bandwidth (nccl-tests), per-kind stats.

Buffer sizes (``buffer_sizes``) say what each rank sends and receives for a kind, from the
trace's element counts and splits; ``check_group_fit`` rejects counts a group of n ranks
cannot produce. Pure Python: no torch, so the same rules serve checks and replay.

Message size (``bytes``) follows nccl-tests: all_reduce, broadcast, reduce, send, recv use
the buffer size; all_gather the total output; reduce_scatter and all_to_all the total
input; gather the total gathered (per-rank input x group size) and scatter the total
scattered (per-rank output x group size). Coalesced kinds count like their base kind.

Algorithm bandwidth = bytes / time; bus bandwidth = algbw x factor, with factor
2(n-1)/n for all_reduce, (n-1)/n for all_gather, reduce_scatter and all_to_all, and 1 for
broadcast, reduce, gather, scatter, send, recv (n = group size).
"""
from __future__ import annotations

_BASE_KIND = {
    "all_reduce_coalesced": "all_reduce",
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "all_to_all_single": "all_to_all",
}


def base_kind(kind: str) -> str:
    """The nccl-tests family a normalized collective kind belongs to."""
    return _BASE_KIND.get(kind, kind)


def element_splits(c, n: int) -> tuple[list[int], list[int]]:
    """all_to_all(_single) splits in elements for Collective ``c`` on ``n`` ranks.

    Traces record dim-0 rows; the row size (elements per row, the same for input and
    output) is in_nelems / sum(in_splits). Without splits the data splits evenly.
    Raises ValueError when the counts do not fit.
    """
    if not c.in_splits and not c.out_splits:
        if c.in_nelems % n or c.out_nelems % n:
            raise ValueError(f"{c.in_nelems}/{c.out_nelems} elements do not split evenly over "
                             f"{n} ranks and the trace has no split sizes")
        return [c.in_nelems // n] * n, [c.out_nelems // n] * n
    if len(c.in_splits) != n or len(c.out_splits) != n:
        raise ValueError(f"split sizes {list(c.in_splits)}/{list(c.out_splits)} do not have "
                         f"one entry per rank of a {n}-rank group")
    rows = sum(c.in_splits)
    if rows == 0 or c.in_nelems % rows:
        raise ValueError(f"{c.in_nelems} input elements do not match input splits "
                         f"{list(c.in_splits)}")
    row = c.in_nelems // rows
    return [s * row for s in c.in_splits], [s * row for s in c.out_splits]


def check_group_fit(c, n: int) -> None:
    """ValueError when Collective ``c``'s element counts contradict a group of ``n`` ranks."""
    base = base_kind(c.kind)
    if base == "all_gather" and c.out_nelems != c.in_nelems * n:
        raise ValueError(f"all-gather of {c.in_nelems} elements into {c.out_nelems} does not "
                         f"fit a {n}-rank group")
    if base == "reduce_scatter" and c.in_nelems != c.out_nelems * n:
        raise ValueError(f"reduce-scatter of {c.in_nelems} elements into {c.out_nelems} does "
                         f"not fit a {n}-rank group")
    if c.kind == "all_to_all_single":  # list all_to_all may be uneven without recorded splits
        element_splits(c, n)


def buffer_sizes(c, n: int, parts: list[int], is_root: bool) -> tuple[list[int], list[int]]:
    """Element counts of the (send, receive) buffer lists of one call of Collective ``c``.

    ``parts``: input sizes of the parts of a coalesced call (else ``[c.in_nelems]``);
    ``is_root``: this rank is the root (only the root has gather's and scatter's lists).
    In-place kinds (all_reduce, broadcast, reduce, send, recv) return one list object twice.
    """
    kind, base = c.kind, base_kind(c.kind)
    if base in ("all_reduce", "broadcast", "reduce", "send"):
        return parts, parts
    if kind == "recv":
        size = [c.out_nelems or c.in_nelems]
        return size, size
    if kind == "all_gather":
        return [c.in_nelems], [c.in_nelems] * n
    if base == "all_gather":
        return parts, [p * n for p in parts]
    if kind == "reduce_scatter":
        return [c.out_nelems] * n, [c.out_nelems]
    if base == "reduce_scatter":
        return parts, [p // n for p in parts]
    if kind == "all_to_all":
        in_split, out_split = element_splits(c, n)
        return in_split, out_split
    if kind == "all_to_all_single":
        in_split, out_split = element_splits(c, n)
        return [sum(in_split)], [sum(out_split)]
    if kind == "gather":
        return [c.in_nelems], ([c.in_nelems] * n if is_root else [])
    if kind == "scatter":
        return ([c.out_nelems] * n if is_root else []), [c.out_nelems]
    raise ValueError(f"collective kind {kind!r} is not replayable")


def message_bytes(kind: str, in_nelems: int, out_nelems: int, itemsize: int,
                  group_size: int) -> int:
    """Message size in bytes of one call, nccl-tests convention (see module doc)."""
    base = base_kind(kind)
    if base == "all_gather":
        return out_nelems * itemsize
    if base == "gather":
        return in_nelems * group_size * itemsize
    if base == "scatter":
        return out_nelems * group_size * itemsize
    if base == "recv":
        return (out_nelems or in_nelems) * itemsize
    if base in ("barrier", "wait"):
        return 0
    return in_nelems * itemsize


def bus_factor(kind: str, group_size: int) -> float:
    """nccl-tests bus-bandwidth factor for ``kind`` on a group of ``group_size`` ranks."""
    n = max(group_size, 1)
    base = base_kind(kind)
    if base == "all_reduce":
        return 2.0 * (n - 1) / n
    if base in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    return 1.0


def alg_bandwidth(num_bytes: float, time_s: float) -> float:
    """Algorithm bandwidth in bytes/s (0 when no time was measured)."""
    return num_bytes / time_s if time_s > 0 else 0.0


def bus_bandwidth(kind: str, num_bytes: float, time_s: float, group_size: int) -> float:
    """Bus bandwidth in bytes/s for one call or one homogeneous set of calls."""
    return alg_bandwidth(num_bytes, time_s) * bus_factor(kind, group_size)


class CommStats:
    """Per-kind accumulator: number of calls, bytes, time and bus-weighted bytes.

    Bus-weighted bytes (bytes x factor of that call's group size) let a kind replayed on
    groups of different sizes still report one meaningful bus bandwidth.
    """

    def __init__(self):
        self._kinds: dict[str, list] = {}  # kind -> [num_calls, bytes, time_s, bus_bytes]

    def add(self, kind: str, num_bytes: int, time_s: float, group_size: int) -> None:
        """Record one completed call."""
        entry = self._kinds.setdefault(kind, [0, 0, 0.0, 0.0])
        entry[0] += 1
        entry[1] += num_bytes
        entry[2] += time_s
        entry[3] += num_bytes * bus_factor(kind, group_size)

    def merge(self, other: "CommStats") -> None:
        """Add another accumulator's totals into this one."""
        for kind, (calls, nbytes, time_s, bus_bytes) in other._kinds.items():
            entry = self._kinds.setdefault(kind, [0, 0, 0.0, 0.0])
            entry[0] += calls
            entry[1] += nbytes
            entry[2] += time_s
            entry[3] += bus_bytes

    def reset(self) -> None:
        """Forget everything (e.g. after warm-up iterations)."""
        self._kinds.clear()

    @property
    def num_calls(self) -> int:
        return sum(entry[0] for entry in self._kinds.values())

    def to_dict(self) -> dict[str, dict]:
        """``{kind: {num_calls, bytes, time_s, algbw_gbps, busbw_gbps}}``; GB/s = 1e9 B/s."""
        out = {}
        for kind in sorted(self._kinds):
            calls, nbytes, time_s, bus_bytes = self._kinds[kind]
            out[kind] = {
                "num_calls": calls,
                "bytes": nbytes,
                "time_s": time_s,
                "algbw_gbps": alg_bandwidth(nbytes, time_s) / 1e9,
                "busbw_gbps": alg_bandwidth(bus_bytes, time_s) / 1e9,
            }
        return out
