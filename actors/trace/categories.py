"""What each storage of a trace holds, for the breakdown of a memory peak (pure data).

Computed from the trace (names say so: these are accounted bytes, not measured ones). Per
storage generation, by its uses over the training phases (actors/trace/phases.py):

* parameters: storages that look like parameters (actors/trace/stats.py), e.g. FSDP2's
  fp32 shards or DeepSpeed's partition;
* gradients: made in backward (or held from before and written in backward) and read by the
  update: DDP's all-reduced gradients, FSDP2's reduce-scattered shards;
* optimizer_state: held from before the iteration and used only by the update;
* buffers: other storages held from before the iteration (rotary tables, a DDP bucket);
* communication: touched by a collective and none of the above (all-gather outputs with
  the gathered parameters on them, reduce-scatter inputs);
* activations: made in forward, still used in backward;
* made_inside: temporaries a composite op made inside itself (actors/trace/made_inside.py);
* temporaries: everything else (made and dead within one phase).
"""
from __future__ import annotations

from actors.trace.liveness import Liveness
from actors.trace.model import Trace
from actors.trace.phases import BWD, FWD, UPDATE, phases
from actors.trace.stats import param_like_storages

CATEGORIES = ("parameters", "gradients", "optimizer_state", "buffers", "communication",
              "activations", "made_inside", "temporaries")
(PARAMETERS, GRADIENTS, OPTIMIZER_STATE, BUFFERS, COMMUNICATION, ACTIVATIONS, MADE_INSIDE,
 TEMPORARIES) = range(len(CATEGORIES))
# What each category means, in the words a prediction shows beside its bytes.
CATEGORY_HELP = {
    "parameters": "the model's parameters (or this rank's shards of them)",
    "gradients": "gradients made in backward and read by the optimizer step",
    "optimizer_state": "the optimizer's state (e.g. Adam's moments), used only by its step",
    "buffers": "other tensors held from before the iteration (rotary tables, DDP buckets)",
    "communication": "collective buffers (all-gathered parameters, reduce-scatter inputs)",
    "activations": "tensors made in forward and kept for backward",
    "made_inside": "temporaries a composite op (attention, a loss, a norm's backward) "
                   "allocated and freed inside itself, never seen by the next op",
    "temporaries": "tensors made and freed within one phase (forward, backward or step)",
}
# Ops that only exist to feed or unpack a collective (FSDP2's copy-in and split-out).
_COMM_OPS = frozenset({"fsdp::all_gather_copy_in", "fsdp::split_with_sizes_copy",
                       "fsdp::chunk_cat"})
_BIT = {FWD: 1, BWD: 2, UPDATE: 4}


def storage_categories(trace: Trace, liveness: Liveness) -> list[int]:
    """A category index (into CATEGORIES) per storage generation (suid)."""
    phase = phases(trace)
    n = trace.num_storages
    used = [0] * n  # bit mask of the phases a storage is used in
    written_bwd = [False] * n
    comm = [False] * n
    for op in trace.ops:
        bit = _BIT[phase[op.index]]
        is_comm = op.collective is not None or op.name in _COMM_OPS
        for t in op.input_tensors():
            if t.suid >= 0:
                used[t.suid] |= bit
                comm[t.suid] = comm[t.suid] or is_comm
        for t in op.output_tensors():
            if t.suid >= 0:
                used[t.suid] |= bit
                comm[t.suid] = comm[t.suid] or is_comm
                written_bwd[t.suid] = written_bwd[t.suid] or bit == 2
    params = set(param_like_storages(trace, liveness.storage_external))
    made_inside = trace.made_inside
    first, last, external = liveness.storage_first, liveness.storage_last, liveness.storage_external
    # a storage a composite op made inside itself began there, not at its first top-level use:
    # saved for backward from a forward op (autocast's bf16 weight copy, an offloaded
    # activation's host copy), it is an activation
    made_at = {suid: start for suid, start, _, _ in trace.nested_lifetimes if suid >= 0}
    out = [TEMPORARIES] * n
    for s in range(n):
        if first[s] < 0:
            continue
        if s in params:
            out[s] = PARAMETERS
        elif (written_bwd[s] or (not external[s] and phase[first[s]] == BWD)) \
                and phase[last[s]] == UPDATE:
            out[s] = GRADIENTS
        elif external[s] and s not in made_inside:
            out[s] = OPTIMIZER_STATE if used[s] == 4 else BUFFERS
        elif comm[s]:
            out[s] = COMMUNICATION
        elif phase[made_at.get(s, first[s])] == FWD and phase[last[s]] != FWD:
            out[s] = ACTIVATIONS
        elif s in made_inside:
            out[s] = MADE_INSIDE
    return out


def breakdown(bytes_by_category: list[int]) -> dict[str, int]:
    """``{category name: bytes}`` of a per-category byte list."""
    return {name: int(b) for name, b in zip(CATEGORIES, bytes_by_category)}
