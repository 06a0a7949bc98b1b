"""tracefleet-predict's dry runs (orchestrator/run/dry_run.py) let each replay's trace and ops
go when the next one starts, with the cyclic GC off as the predict command runs. Two things
held them to the end: the first replay's first import of torch._dynamo, from inside an op, kept
that replay's frames (its trace and engine) in a reference cycle; and the allocator model's
timeline (on when a prediction is written) kept every stage's ops through the replay's memory
tracker, which lies on a cycle of its own. Run in a fresh process: torch._dynamo must not be
imported yet."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from tests.support.bounds import CAPTURE_BOUND_S

_SCRIPT = textwrap.dedent("""
    import gc, json, sys, weakref
    gc.disable()
    from actors.replay.config import AllocationMode, dry_run_config
    from actors.replay.memory.target import TargetConfig
    from actors.trace import loader
    from actors.trace.source import as_source
    from orchestrator.config import DEMO_TRACES
    from orchestrator.run.dry_run import dry_run

    assert "torch._dynamo" not in sys.modules
    loaded, real = [], loader._load_trace
    def spy(*args):
        trace = real(*args)
        loaded.append(weakref.ref(trace))
        return trace
    loader._load_trace = spy
    sources = {r: as_source(str(DEMO_TRACES / "gpt_zero3_2" / f"rank-{r}.et.json.gz"))
               for r in (0, 1)}
    replay = dry_run_config(AllocationMode.faithful)
    replay.allocator_timeline = True  # as predict sets it when it writes prediction.html
    groups, _ = dry_run(sources, replay, TargetConfig(name="h100_96gb"), None)
    alive = [ref() is not None for ref in loaded]
    gc.set_debug(gc.DEBUG_SAVEALL)  # what a collection finds stays in gc.garbage
    gc.collect()
    ops = sum(type(o).__name__ == "Op" for o in gc.garbage)
    print(json.dumps({"groups": len(groups), "alive": alive, "ops_held_by_cycles": ops}))
""")


def test_each_replays_trace_is_freed_with_the_gc_off():
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True,
                          timeout=CAPTURE_BOUND_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["groups"] == 2 and out["alive"] == [False, False]
    # each demo trace has ~600 ops: a cycle may hold the op a tracker last saw, not the trace's
    assert out["ops_held_by_cycles"] <= 10


def test_distinct_traces_dry_run_at_once_in_workers_as_here():
    """num_workers=2 (predict.roles.num_workers on a mesh job): each distinct trace in a spawned
    process of its own, the same reports as one after another in this process."""
    from actors.replay.config import AllocationMode, dry_run_config
    from actors.replay.memory.target import TargetConfig
    from actors.trace.source import as_source
    from orchestrator.config import DEMO_TRACES
    from orchestrator.run.dry_run import dry_run

    sources = {r: as_source(str(DEMO_TRACES / "gpt_zero3_2" / f"rank-{r}.et.json.gz"))
               for r in (0, 1)}
    args = (sources, dry_run_config(AllocationMode.faithful), TargetConfig(name="h100_96gb"),
            None)
    here, in_workers = dry_run(*args), dry_run(*args, num_workers=2)
    assert here[0] == in_workers[0] and len(here[0]) == 2  # two distinct traces

    def figures(reports):
        return {rank: (r["status"], r["accounted_peak_bytes"], r["peak_breakdown"],
                       r["cuda_allocator"]["predicted_reserved_peak_bytes"])
                for rank, r in reports.items()}
    assert figures(here[1]) == figures(in_workers[1])
