"""Hand-made memory snapshots in torch's ``_snapshot()`` layout, for the comparison tests."""
from __future__ import annotations

MiB = 1 << 20


def frames(name: str) -> list[dict]:
    return [{"filename": "train.py", "line": 7, "name": name}]


def history(sizes: list[tuple[int, str]], segment: int = 64 * MiB) -> dict:
    """A snapshot whose history allocates ``(size, where)`` in order, then frees everything
    but the last, in one segment."""
    trace = [{"action": "segment_alloc", "addr": 0, "size": segment, "stream": 0,
              "frames": frames("first")}]
    addr, live = 0, []
    for size, where in sizes:
        trace.append({"action": "alloc", "addr": addr, "size": size, "stream": 0,
                      "frames": frames(where)})
        live.append((addr, size))
        addr += size
    for a, size in live[:-1]:
        trace += [{"action": "free_requested", "addr": a, "size": size, "stream": 0},
                  {"action": "free_completed", "addr": a, "size": size, "stream": 0}]
    a, size = live[-1]
    blocks = [{"address": 0, "size": a, "requested_size": 0, "state": "inactive"}] if a else []
    blocks += [{"address": a, "size": size, "requested_size": size, "state": "active_allocated",
                "frames": frames(sizes[-1][1])},
               {"address": a + size, "size": segment - a - size, "requested_size": 0,
                "state": "inactive"}]
    return {"segments": [{"device": 0, "address": 0, "total_size": segment, "stream": 0,
                          "blocks": blocks}], "device_traces": [trace]}
