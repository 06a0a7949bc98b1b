"""The one place a replay's extensions are built (actors/replay/extension_contract.py has
the contract).

Order matters: extensions attach, hook and report in list order. The memory meter comes
first (it measures what the others allocate), then the reserved-memory model (it sees what
the others charge), the caller's own extensions (the layers above the engine bring theirs
this way: ZeRO-3's from actors/zero3/extension.py), host gaps, nested memory and the
collectives last (an async collective completes after a host gap planned at the same op: the
wait is part of that gap).
"""
from __future__ import annotations

import torch

from actors.errors import ReplayError
from actors.replay.comm.extension import Collectives
from actors.replay.config import AllocationMode, ReplayConfig
from actors.replay.extension_contract import ReplayExtension
from actors.replay.host_gaps import HostGaps
from actors.replay.memory.meters import MemoryMeter, make_meter
from actors.replay.memory.nested_memory import NestedMemory
from actors.replay.memory.model_recording import reserved_model_extensions
from actors.replay.memory.target import TargetConfig
from actors.trace.model import Trace


def build_extensions(trace: Trace, cfg: ReplayConfig, device: torch.device, comm=None,
                     extra=(), target: TargetConfig | None = None) -> list[ReplayExtension]:
    """Every extension of one rank's replay of ``trace``: the ones ``cfg`` asks for (memory
    meter, host gaps, nested memory), the collectives when ``comm`` (a CollectiveReplayer) is
    given, the reserved-memory model when ``target`` names a device, and ``extra`` (the
    caller's own, e.g. the ZeRO-3 emulation's). Refuses a mode that needs process groups when ``comm`` is None."""
    if cfg.mode != "compute" and comm is None and any(op.collective for op in trace.ops):
        raise ReplayError(f"replay.mode={cfg.mode} needs process groups; this engine has none "
                          "(use replay.mode=compute for a single-process replay)")
    exts = [MemoryMeter(make_meter(device, cfg.measure_memory)),
            *reserved_model_extensions(target, cfg.allocator_snapshot, cfg.allocator_timeline),
            *extra]
    if cfg.host_gaps:
        exts.append(HostGaps.for_trace(trace))
    if trace.nested_lifetimes and cfg.allocation.mode == AllocationMode.faithful:
        exts.append(NestedMemory(trace.nested_lifetimes))
    if comm is not None:
        exts.append(Collectives(comm))
    return exts
