"""The cyclic GC pauses while an engine builds and runs (actors/gc_pause.py): a collection
would rescan the trace's objects inside a timed iteration."""
from __future__ import annotations

import gc

import pytest

from actors.gc_pause import gc_paused
from actors.replay.config import ReplayConfig
from actors.replay.engine import ReplayEngine
from actors.replay.extension_contract import ReplayExtension
from actors.trace import load_trace
from orchestrator.config import DEMO_TRACES

DEMO = DEMO_TRACES / "gpt_dp_4" / "rank-0.et.json.gz"


def test_paused_inside_restored_after_even_on_error():
    assert gc.isenabled()
    with pytest.raises(ValueError):
        with gc_paused():
            assert not gc.isenabled()
            raise ValueError
    assert gc.isenabled()
    gc.disable()  # off before: stays off
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


class _SeesGc(ReplayExtension):
    def __init__(self):
        self.seen = []

    def attach(self, engine) -> None:
        self.seen.append(("attach", gc.isenabled()))

    def on_iteration_start(self) -> None:
        self.seen.append(("iteration", gc.isenabled()))


def test_engine_setup_and_iterations_run_with_the_collector_paused():
    ext = _SeesGc()
    cfg = ReplayConfig(mode="compute", device="meta", iters=2, warmup_iters=1,
                       measure_memory=False)
    engine = ReplayEngine(load_trace(DEMO), cfg, extensions=[ext])
    assert gc.isenabled()  # back on between setup and run
    assert engine.run().to_dict()["status"] == "ok"
    assert gc.isenabled()
    assert ext.seen == [("attach", False)] + [("iteration", False)] * 3
