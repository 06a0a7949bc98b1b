"""A recorded memory snapshot (a GPU run's ``torch.cuda.memory._dump_snapshot``) beside a
predicted one (``tracefleet-predict predict.snapshot=true``): the allocated and reserved peaks
of each, the op (frames) at each peak, and the first point where the two allocation streams
part.

Both are read from their ``device_traces`` the same way, so they compare alike: allocated is
the sum of the live allocations' requested bytes (memory_viz's "allocated"), reserved the sum
of the mapped segments; a history that starts after memory was already held (recording turned
on mid-run) starts from the snapshot's final state less what the history added.

The streams are the ``alloc`` events' sizes in order. Where they part, they are re-aligned by
skipping the fewest events on either side (within ``window``) after which two allocations in a
row agree again (the cuBLAS workspace a GPU allocates at its first matmul, where the prediction
allocates it first, is one such skip); the first point where none does is where they diverge
for good.
"""
from __future__ import annotations

from dataclasses import dataclass

from orchestrator.units import human_bytes, one_line

RESYNC_WINDOW = 16  # events skipped on either side to re-align the streams
_GROW = {"segment_alloc": 1, "segment_map": 1, "segment_free": -1, "segment_unmap": -1}


@dataclass
class Peaks:
    """One snapshot's figures, from one device's history."""

    allocated_peak_bytes: int
    reserved_peak_bytes: int
    allocated_peak_event: dict | None  # the alloc that reached the allocated peak
    reserved_peak_event: dict | None  # the segment event that reached the reserved peak
    num_allocs: int
    allocs: list  # the alloc events, in order


def device_of(snap: dict, device: int | None) -> int:
    """``device``, else the device with the longest history."""
    traces = snap["device_traces"]
    if device is not None:
        return device
    return max(range(len(traces)), key=lambda d: len(traces[d]), default=0)


def peaks(snap: dict, device: int | None = None) -> Peaks:
    """The peaks of ``device``'s history (its longest one by default)."""
    d = device_of(snap, device)
    trace = snap["device_traces"][d] if d < len(snap["device_traces"]) else []
    segs = [s for s in snap["segments"] if s.get("device", 0) == d]
    reserved_end = sum(s["total_size"] for s in segs)
    allocated_end = sum(b.get("requested_size", b.get("size", 0)) for s in segs
                        for b in s["blocks"] if b.get("state") == "active_allocated")
    net_alloc = net_reserved = 0
    for e in trace:
        action, size = e["action"], e.get("size", 0)
        if action == "alloc":
            net_alloc += size
        elif action == "free_completed":
            net_alloc -= size
        elif action in _GROW:
            net_reserved += _GROW[action] * size
    allocated, reserved = allocated_end - net_alloc, reserved_end - net_reserved
    out = Peaks(allocated, reserved, None, None, 0, [])
    for e in trace:
        action, size = e["action"], e.get("size", 0)
        if action == "alloc":
            allocated += size
            out.allocs.append(e)
            if allocated > out.allocated_peak_bytes or out.allocated_peak_event is None:
                out.allocated_peak_bytes, out.allocated_peak_event = allocated, e
        elif action == "free_completed":
            allocated -= size
        elif action in _GROW:
            reserved += _GROW[action] * size
            if reserved > out.reserved_peak_bytes or out.reserved_peak_event is None:
                out.reserved_peak_bytes, out.reserved_peak_event = reserved, e
    out.allocated_peak_bytes = max(out.allocated_peak_bytes, allocated_end)
    out.reserved_peak_bytes = max(out.reserved_peak_bytes, reserved_end)
    out.num_allocs = len(out.allocs)
    return out


def where(event: dict | None, num_frames: int = 2) -> str:
    """The innermost frames of an event, ``file:line:name`` (file names shortened)."""
    if event is None:
        return "-"
    frames = [f for f in event.get("frames") or [] if isinstance(f, dict)]
    if not frames:
        return "(no frames recorded)"
    shown = []
    for f in frames[:num_frames]:
        filename = "/".join(str(f.get("filename", "?")).split("/")[-2:])
        line, name = str(f.get("line", 0)), f.get("name", "?")
        shown.append(f"{one_line(filename)}:{one_line(line)}:{one_line(name)}")
    return " < ".join(shown)



def _match(a: list, b: list, i: int, j: int) -> bool:
    """Two allocations in a row agree from (i, j) on (or the streams end together)."""
    for k in range(2):
        if i + k >= len(a) or j + k >= len(b):
            return i + k >= len(a) and j + k >= len(b) or k > 0
        if a[i + k]["size"] != b[j + k]["size"]:
            return False
    return True


def divergence(recorded: list, predicted: list, window: int = RESYNC_WINDOW) -> dict:
    """Where the alloc streams part: ``first`` (the first differing pair), ``lasting`` (the
    first point no re-alignment within ``window`` rescues), the skips made and how many
    allocations agreed; each point is ``(recorded index, predicted index)``."""
    i = j = matched = 0
    first = lasting = None
    skips = []
    while i < len(recorded) and j < len(predicted):
        if recorded[i]["size"] == predicted[j]["size"]:
            i, j, matched = i + 1, j + 1, matched + 1
            continue
        if first is None:
            first = (i, j)
        step = next(((a, d - a) for d in range(1, 2 * window + 1)
                     for a in range(max(0, d - window), min(d, window) + 1)
                     if _match(recorded, predicted, i + a, j + d - a)), None)
        if step is None:
            lasting = (i, j)
            break
        skips.append({"at": (i, j), "recorded_skipped": step[0], "predicted_skipped": step[1]})
        i, j = i + step[0], j + step[1]
    if lasting is None and (i < len(recorded)) != (j < len(predicted)):
        lasting = (i, j)  # one stream goes on alone
        first = first or lasting
    return {"first": first, "lasting": lasting, "skips": skips, "num_matched": matched}


def compare(recorded: dict, predicted: dict, device: int | None = None) -> dict:
    """The figures of both snapshots and where they part (``compare_lines`` prints them)."""
    rec, pred = peaks(recorded, device), peaks(predicted, 0)
    div = divergence(rec.allocs, pred.allocs)

    def point(at):
        if at is None:
            return None
        i, j = at
        side = {}
        for name, allocs, k in (("recorded", rec.allocs, i), ("predicted", pred.allocs, j)):
            e = allocs[k] if k < len(allocs) else None
            side[name] = {"index": k, "size": e["size"] if e else None, "where": where(e)}
        return side

    return {
        "recorded": {"allocated_peak_bytes": rec.allocated_peak_bytes,
                     "reserved_peak_bytes": rec.reserved_peak_bytes,
                     "at_allocated_peak": where(rec.allocated_peak_event),
                     "at_reserved_peak": where(rec.reserved_peak_event),
                     "num_allocs": rec.num_allocs},
        "predicted": {"allocated_peak_bytes": pred.allocated_peak_bytes,
                      "reserved_peak_bytes": pred.reserved_peak_bytes,
                      "at_allocated_peak": where(pred.allocated_peak_event),
                      "at_reserved_peak": where(pred.reserved_peak_event),
                      "num_allocs": pred.num_allocs},
        "ratio_allocated": _ratio(pred.allocated_peak_bytes, rec.allocated_peak_bytes),
        "ratio_reserved": _ratio(pred.reserved_peak_bytes, rec.reserved_peak_bytes),
        "num_matched_allocs": div["num_matched"],
        "first_divergence": point(div["first"]),
        "lasting_divergence": point(div["lasting"]),
        "num_realignments": len(div["skips"]),
    }


def _ratio(a: int, b: int) -> float | None:
    return round(a / b, 4) if b else None


def compare_lines(c: dict, recorded_name: str, predicted_name: str) -> list[str]:
    """The comparison as a markdown table and the divergence lines."""
    r, p = c["recorded"], c["predicted"]
    rows = [("allocated peak (requested bytes)", human_bytes(r["allocated_peak_bytes"]),
             human_bytes(p["allocated_peak_bytes"]), _fmt(c["ratio_allocated"])),
            ("reserved peak", human_bytes(r["reserved_peak_bytes"]),
             human_bytes(p["reserved_peak_bytes"]), _fmt(c["ratio_reserved"])),
            ("at the allocated peak", r["at_allocated_peak"], p["at_allocated_peak"], ""),
            ("at the reserved peak", r["at_reserved_peak"], p["at_reserved_peak"], ""),
            ("allocations", str(r["num_allocs"]), str(p["num_allocs"]), "")]
    lines = [f"tracefleet-compare: recorded {recorded_name} | predicted {predicted_name}", "",
             "| what | recorded | predicted* | predicted / recorded |", "|---|---|---|---|"]
    lines += [f"| {a} | {b} | {d} | {e} |" for a, b, d, e in rows]
    lines.append("")
    first, lasting = c["first_divergence"], c["lasting_divergence"]
    if first is None:
        lines.append(f"the allocation streams agree: {c['num_matched_allocs']} allocations of "
                     "the same sizes in the same order")
        return lines
    lines.append("first divergence: " + _point(first) +
                 f" ({c['num_matched_allocs']} allocations agree in all)")
    if lasting is None:
        lines.append(f"the streams re-align after each of {c['num_realignments']} divergence(s) "
                     f"(within {RESYNC_WINDOW} allocations)")
    elif lasting != first:
        lines.append("they part for good at: " + _point(lasting))
    else:
        lines.append(f"no re-alignment within {RESYNC_WINDOW} allocations: they part for good "
                     "there")
    lines.append("* predicted by the caching allocator model")
    return lines


def _point(side: dict) -> str:
    r, p = side["recorded"], side["predicted"]
    return (f"recorded allocation #{r['index']} {human_bytes(r['size'])} at {r['where']}; "
            f"predicted allocation #{p['index']} {human_bytes(p['size'])} at {p['where']}")


def _fmt(ratio) -> str:
    return "-" if ratio is None else f"{ratio:.4f}"
