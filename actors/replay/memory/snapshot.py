"""A predicted memory snapshot in the layout ``torch.cuda.memory._snapshot()`` returns, for
PyTorch's own viewers (pytorch.org/memory_viz, ``torch.cuda._memory_viz``) and for
``tracefleet-compare`` against one recorded on a GPU.

Built from the caching allocator model's own segments and blocks (its state after the replay)
and its history (actors/replay/memory/allocator_events.py): ``segments`` (``device``,
``address``, ``total_size``, ``stream``, ``blocks`` with ``size``, ``requested_size``,
``state`` and ``frames``), ``device_traces`` (one list for device 0: ``alloc``,
``free_requested``, ``free_completed``, ``segment_alloc``, ``segment_free``, ``segment_map``,
``segment_unmap`` and ``oom`` entries with ``addr``, ``size``, ``stream`` and ``frames``).

Frames stand where a GPU snapshot has the Python stack, innermost first (``replay:0:held before
the first op`` for what is allocated before it): the op (``node:<node id>:<op name>``), its
innermost record_function range (``range:0:<name>``: a module's forward range, an autograd
node, FSDP2's or the optimizer's range), for a module range the enclosing
modules by qualified name (``module:0:layers.0``), and the iteration (``iteration:<k>:
warm-up|measured``). One list per (iteration, op), shared by every entry made there, so the
pickle stays small. Alloc entries carry the storage's ``category`` (the viewer colours by it).

Pickled with protocol 4 and plain types only (dict, list, str, int, bool, None): the
viewer's own unpickler reads protocols 2 to 4 and no other types.
"""
from __future__ import annotations

import pickle
from pathlib import Path

from actors.atomic_file import atomic_write
from actors.replay.memory.allocator_events import ACTIONS, ALLOC, NO_CATEGORY, OOM, UNTAGGED
from actors.trace.categories import CATEGORIES
from actors.trace.conventions import parse_module_range

PICKLE_PROTOCOL = 4  # memory_viz's unpickler refuses 5
SNAPSHOT_FILE = "snapshot_rank{rank}.pickle"
UNKNOWN = "unknown"  # the viewer's name for an allocation of no category


class FrameTable:
    """The frames of each (iteration, op) tag, made once and shared."""

    def __init__(self, ops, num_warmup_iters: int):
        self.ops, self.num_warmup = ops, num_warmup_iters
        # what is allocated before the first op: the state held from before the iteration
        # (parameters, buffers, ...) and the cuBLAS workspace
        self._frames: dict[int, list] = {UNTAGGED: [{"filename": "replay", "line": 0,
                                                     "name": "held before the first op"}]}

    def tag(self, iteration: int, op_index: int) -> int:
        """The tag of op ``op_index`` in 0-based ``iteration`` (UNTAGGED without an op)."""
        return UNTAGGED if op_index < 0 else iteration * len(self.ops) + op_index

    def frames(self, tag: int) -> list[dict]:
        found = self._frames.get(tag)
        if found is None:
            found = self._frames[tag] = self._make(tag)
        return found

    def _make(self, tag: int) -> list[dict]:
        iteration, index = divmod(tag, len(self.ops))
        op = self.ops[index]
        frames = [{"filename": "node", "line": op.node_id, "name": op.name}]
        if op.module:
            frames.append({"filename": "range", "line": 0, "name": op.module})
            parsed = parse_module_range(op.module)
            if parsed is not None and parsed[0]:
                parts = parsed[0].split(".")
                frames += [{"filename": "module", "line": 0, "name": ".".join(parts[:k])}
                           for k in range(len(parts) - 1, 0, -1)]
        kind = "warm-up" if iteration < self.num_warmup else "measured"
        frames.append({"filename": "iteration", "line": iteration + 1, "name": kind})
        return frames


_NAMES = {**dict(enumerate(CATEGORIES)), NO_CATEGORY: UNKNOWN}


def build_snapshot(model, table: FrameTable, extra: dict | None = None) -> dict:
    """The snapshot dict of a RecordingAllocatorModel (its state now and its history);
    ``extra`` goes under the key ``tracefleet`` (what the prediction was of)."""
    trace = []
    cats = set()
    for event in model.events:
        action, addr, size, stream, tag = event[:5]
        entry = {"action": ACTIONS[action], "addr": addr, "size": size, "stream": stream,
                 "frames": table.frames(tag)}
        if action == ALLOC:
            entry["category"] = _NAMES[event[5]]
            cats.add(entry["category"])
        elif action == OOM:
            del entry["addr"]
            entry["device_free"] = event[5]
        trace.append(entry)
    if cats and UNKNOWN not in cats:  # the viewer needs "unknown" among the categories
        for entry in trace:
            entry.pop("category", None)
    return {"segments": _segments(model, table), "device_traces": [trace],
            **({"tracefleet": extra} if extra else {})}


def _segments(model, table: FrameTable) -> list[dict]:
    """Every segment now reserved (an expandable range: each run of mapped pages), its blocks
    in address order."""
    known = [entry[3] for entry in model.live.values()]
    for pool in model.pools.values():
        known += pool.blocks.values()
    seen: set[int] = set()
    segments = []
    for block in known:
        if id(block) in seen:
            continue
        head = block
        while head.prev is not None:
            head = head.prev
        run: list = []
        b = head
        while b is not None:
            seen.add(id(b))
            if b.mapped:
                run.append(b)
            elif run:
                segments.append(_segment(model, run, table))
                run = []
            b = b.next
        if run:
            segments.append(_segment(model, run, table))
    segments.sort(key=lambda s: s["address"])
    return segments


def _segment(model, blocks: list, table: FrameTable) -> dict:
    pool = blocks[0].pool
    out, allocated, requested = [], 0, 0
    for b in blocks:
        if b.allocated:
            nbytes, tag, _, _ = model.live[b.addr]
            allocated += b.size
            requested += nbytes
            out.append({"address": b.addr, "size": b.size, "requested_size": nbytes,
                        "state": "active_allocated", "frames": table.frames(tag)})
        else:
            out.append({"address": b.addr, "size": b.size, "requested_size": 0,
                        "state": "inactive", "frames": []})
    total = sum(b.size for b in blocks)
    return {"device": 0, "address": blocks[0].addr, "total_size": total,
            "allocated_size": allocated, "active_size": allocated, "requested_size": requested,
            "stream": pool.stream, "segment_type": "small" if pool.small else "large",
            "segment_pool_id": (0, 0), "is_expandable": model.expandable, "blocks": out}


def snapshot_bytes(snapshot: dict) -> bytes:
    """The snapshot pickled as ``torch.cuda.memory._dump_snapshot`` writes it (protocol 4)."""
    return pickle.dumps(snapshot, protocol=PICKLE_PROTOCOL)


def write_snapshots(out_dir, snapshots: dict) -> dict[str, str]:
    """Write each rank's pickled snapshot (``{rank: bytes or None}``) as
    ``snapshot_rank<r>.pickle`` into ``out_dir``; returns ``{rank: file name}``."""
    written = {}
    for rank, data in sorted(snapshots.items()):
        if data is not None:
            name = SNAPSHOT_FILE.format(rank=rank)
            atomic_write(Path(out_dir) / name, data)
            written[str(rank)] = name
    return written
