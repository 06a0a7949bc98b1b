"""What PyTorch's memory viewer needs of a snapshot, checked without its JavaScript
(MemoryViz.js is loaded from a CDN by the page ``torch.cuda._memory_viz`` writes; this machine
and CI reach no CDN).

* ``VIEWER_OPCODES``: the pickle opcodes the viewer's own unpickler reads (protocols 2-4; it
  throws on any other), from torch/utils/viz/MemoryViz.js's ``unpickle``;
* ``replay_history``: the snapshot's history replayed from an empty device must reach its
  ``segments`` exactly, which is what the viewer's segment view assumes when it walks the
  history back from the final state (an event it cannot place throws there);
* ``memory_viz_page``: a page of ``trace_plot`` / ``segment_plot`` with the viewer's module
  swapped for ``memory_viz_standin.js`` (beside this file), which reads the snapshot the way
  the viewer does and writes what it found into ``<pre id="viewer-probe">``.
"""
from __future__ import annotations

import base64
import pickletools
import re
from pathlib import Path

VIEWER_OPCODES = frozenset({
    "PROTO", "FRAME", "STOP", "MARK", "MEMOIZE", "BINPUT", "LONG_BINPUT", "BINGET",
    "LONG_BINGET", "EMPTY_DICT", "DICT", "SETITEM", "SETITEMS", "EMPTY_LIST", "LIST", "APPEND",
    "APPENDS", "EMPTY_TUPLE", "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "NONE", "NEWTRUE",
    "NEWFALSE", "BININT", "BININT1", "BININT2", "LONG1", "BINFLOAT", "SHORT_BINUNICODE",
    "BINUNICODE"})
VIEWER_PROTOCOLS = range(2, 5)
_VIEWER_IMPORT = re.compile(r'import \{add_local_files\} from "[^"]+"')
STANDIN = Path(__file__).with_name("memory_viz_standin.js")


def opcodes_outside_the_viewer(data: bytes) -> set[str]:
    """Opcodes (and a protocol) of ``data`` the viewer's unpickler would throw on."""
    bad = set()
    for op, arg, _ in pickletools.genops(data):
        if op.name not in VIEWER_OPCODES:
            bad.add(op.name)
        elif op.name == "PROTO" and arg not in VIEWER_PROTOCOLS:
            bad.add(f"PROTO {arg}")
    return bad


def replay_history(snap: dict, device: int = 0) -> dict:
    """Replay ``device_traces[device]`` from nothing; assert every event is placeable and that
    the end is the snapshot's ``segments``. Returns the peaks reached (requested bytes
    allocated, bytes reserved) and the event counts."""
    mapped: dict[int, int] = {}  # address -> size of each mapped range (segments, maps)
    blocks: dict[int, int] = {}  # address -> requested bytes of each live allocation
    pending: dict[int, int] = {}  # free_requested, not yet completed
    allocated = reserved = peak_allocated = peak_reserved = 0
    counts: dict[str, int] = {}

    def inside(addr: int) -> bool:
        return any(a <= addr < a + n for a, n in mapped.items())

    for k, e in enumerate(snap["device_traces"][device]):
        action = e["action"]
        counts[action] = counts.get(action, 0) + 1
        if action == "alloc":
            assert e["addr"] not in blocks, f"event {k}: {e['addr']} allocated twice"
            assert inside(e["addr"]), f"event {k}: alloc outside every segment"
            blocks[e["addr"]] = e["size"]
            allocated += e["size"]
            peak_allocated = max(peak_allocated, allocated)
        elif action == "free_requested":
            assert blocks.get(e["addr"]) == e["size"], f"event {k}: frees what is not held"
            pending[e["addr"]] = e["size"]
        elif action == "free_completed":
            assert pending.pop(e["addr"], None) == e["size"], f"event {k}: free not requested"
            allocated -= blocks.pop(e["addr"])
        elif action in ("segment_alloc", "segment_map"):
            assert not inside(e["addr"]), f"event {k}: maps memory already mapped"
            mapped[e["addr"]] = e["size"]
            reserved += e["size"]
            peak_reserved = max(peak_reserved, reserved)
        elif action in ("segment_free", "segment_unmap"):
            start, end = e["addr"], e["addr"] + e["size"]
            assert not any(start <= a < end for a in blocks), f"event {k}: frees live blocks"
            _unmap(mapped, start, end, k)
            reserved -= e["size"]
        elif action == "oom":
            assert e["size"] > 0 and "device_free" in e
    assert not pending, "frees requested and never completed"
    final = {b["address"]: b["requested_size"] for s in snap["segments"] for b in s["blocks"]
             if s["device"] == device and b["state"] == "active_allocated"}
    assert final == blocks, "the history does not end in the snapshot's live blocks"
    assert sum(s["total_size"] for s in snap["segments"]) == reserved
    for s in snap["segments"]:
        assert sum(b["size"] for b in s["blocks"]) == s["total_size"]
        assert s["blocks"][0]["address"] == s["address"]
        for a, b in zip(s["blocks"], s["blocks"][1:]):
            assert a["address"] + a["size"] == b["address"], "blocks do not tile the segment"
    return {"peak_allocated": peak_allocated, "peak_reserved": peak_reserved,
            "allocated": allocated, "reserved": reserved, "counts": counts}


def _unmap(mapped: dict[int, int], start: int, end: int, k: int) -> None:
    """Take [start, end) out of the mapped ranges (a whole segment, or pages of one)."""
    for a, n in list(mapped.items()):
        if a <= start and end <= a + n:
            del mapped[a]
            if a < start:
                mapped[a] = start - a
            if end < a + n:
                mapped[end] = a + n - end
            return
    raise AssertionError(f"event {k}: unmaps [{start}, {end}) that is not one mapped range")


def memory_viz_page(html: str) -> str:
    """``html`` (a page ``trace_plot`` / ``segment_plot`` made) with the viewer's module
    replaced by memory_viz_standin.js, inlined as a data: URL (a file:// page may not load
    a module from a file)."""
    data = base64.b64encode(STANDIN.read_bytes()).decode()
    page, n = _VIEWER_IMPORT.subn(
        f'import {{add_local_files}} from "data:text/javascript;base64,{data}"', html)
    assert n == 1, "memory_viz's page no longer imports add_local_files as expected"
    return page
