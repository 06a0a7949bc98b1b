"""The profiler trace capture writes beside an ET: timing of a bare profiler-only iteration,
keyed to the ET's record-function ids.

The ET observer's per-op work lands between the profiler's op events, and so does the Python
of the module ranges' hooks (actors/capture/recorder.py): recorded with both, the host gaps
of the demo ZeRO-3 workload come out at ~90% of the eager iteration, against ~50% for a bare
iteration under the profiler alone, which itself adds ~1 us per gap
(scripts/bench_host_gaps.py). So capture records the ET's iteration A with the observer,
the hooks and the profiler (their record-function ids agree), then bare iterations B under
the profiler alone. The host thread's op events of A, less the hooks' own functions
and ops, and of B are aligned by name with a sequence matcher (the hooks also move a few of
the autograd engine's gradient accumulations), and B's events are written with A's ids: the
ET links to B's timing. Events of B left unaligned lose
their id (kept as ``Profiler record function id``), so no id of B can collide with an ET op's.
"""
from __future__ import annotations

import difflib
import gzip

import orjson

RF_ID = "Record function id"
UNLINKED_RF_ID = "Profiler record function id"
STEP_PREFIX = "ProfilerStep#"
# torch.utils.hooks: a full backward hook runs module inputs and outputs (and their
# gradients) through this autograd function: BackwardHookFunction, ...Backward.
HOOK_PREFIX = "BackwardHookFunction"


def _host_ops(events: list[dict], drop_hooks: bool = False) -> list[dict]:
    """cpu_op events on the thread that ran the step, in start order (parents first);
    ``drop_hooks`` leaves out the full backward hooks' autograd functions and what runs
    inside them (the ops only the module ranges add)."""
    step = next((e for e in events if e.get("ph") == "X" and e.get("cat") == "user_annotation"
                 and str(e.get("name")).startswith(STEP_PREFIX)), None)
    if step is None:
        return []
    ops = [e for e in events
           if e.get("ph") == "X" and e.get("cat") == "cpu_op" and e.get("tid") == step.get("tid")]
    ops.sort(key=lambda e: (float(e["ts"]), -float(e.get("dur", 0.0))))
    if not drop_hooks:
        return ops
    kept, hook_end = [], -1.0
    for e in ops:
        if float(e["ts"]) <= hook_end:
            continue  # inside a hook function
        if str(e.get("name")).startswith(HOOK_PREFIX):
            hook_end = float(e["ts"]) + float(e.get("dur", 0.0))
            continue
        kept.append(e)
    return kept


def relabel(et_profile: dict, timing_profile: dict) -> tuple[dict, int, int]:
    """``timing_profile`` with its host op events carrying the ids of their counterparts in
    ``et_profile`` (both Chrome/Kineto trace documents); ``(doc, aligned, host ops of A)``."""
    a_ops = _host_ops(et_profile["traceEvents"], drop_hooks=True)
    b_ops = _host_ops(timing_profile["traceEvents"])
    a_names, b_names = [e["name"] for e in a_ops], [e["name"] for e in b_ops]
    if a_names == b_names:
        pairs = list(zip(a_ops, b_ops))
    else:
        matcher = difflib.SequenceMatcher(a=a_names, b=b_names, autojunk=False)
        pairs = [(a_ops[m.a + k], b_ops[m.b + k])
                 for m in matcher.get_matching_blocks() for k in range(m.size)]
    for ev in timing_profile["traceEvents"]:
        args = ev.get("args")
        if ev.get("cat") == "cpu_op" and isinstance(args, dict) and RF_ID in args:
            args[UNLINKED_RF_ID] = args.pop(RF_ID)
    for a, b in pairs:
        rf_id = (a.get("args") or {}).get(RF_ID)
        if rf_id is not None:
            b["args"][RF_ID] = rf_id
            b["args"].pop(UNLINKED_RF_ID, None)
    timing_profile["tracefleet"] = {
        "timing": "bare profiler-only iteration after the ET's; host ops carry the ET's "
                  "record function ids (actors/capture/host_profile.py)",
        "aligned_host_ops": len(pairs), "et_host_ops": len(a_ops)}
    return timing_profile, len(pairs), len(a_ops)


def write_relabeled(et_profile_path: str, timing_profile_path: str, out_path: str) -> dict:
    """Read the two exported profiles, write the relabeled one gzipped to ``out_path``;
    returns ``{"aligned_host_ops", "et_host_ops"}``."""
    with open(et_profile_path, "rb") as f:
        a = orjson.loads(f.read())
    with open(timing_profile_path, "rb") as f:
        b = orjson.loads(f.read())
    doc, aligned, total = relabel(a, b)
    with gzip.open(out_path, "wb", compresslevel=6) as f:
        f.write(orjson.dumps(doc))
    return {"aligned_host_ops": aligned, "et_host_ops": total}
