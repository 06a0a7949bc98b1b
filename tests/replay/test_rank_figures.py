"""The typed rank report: RankFigures is what the report's dict is made of, in its order, and a
consumer reads the dict back as the same figures (the memory meter's headline replaces its
four in place)."""
from __future__ import annotations

import dataclasses

from actors.replay.config import AllocationConfig, ReplayConfig
from actors.replay.engine import ReplayEngine
from actors.replay.report import RankFigures
from actors.trace import load_trace
from orchestrator.config import DEMO_TRACES

METER = ("measured_peak_bytes", "peak_memory_source", "memory_measure_method", "memory_measure")


def test_the_rank_figures_read_back_from_the_report_they_wrote():
    trace = load_trace(str(DEMO_TRACES / "gpt_dp_4" / "rank-0.et.json.gz"))
    cfg = ReplayConfig(mode="compute", device="cpu", iters=1, warmup_iters=0,
                       allocation=AllocationConfig(mode="lazy"))
    engine = ReplayEngine(trace, cfg)
    try:
        report = engine.run()
    finally:
        engine.close()
    d = report.to_dict()
    back = RankFigures.of(d)
    assert dataclasses.replace(back, **{k: getattr(report.figures, k) for k in METER}) == \
        report.figures
    assert back.accounted_peak_bytes > 0 and back.coverage == 1.0
    # the figures' keys keep the report's order; the extensions' parts come after them
    core = list(back.to_dict())
    assert [k for k in d if k in core] == core
    assert list(d)[:10] == ["rank", "node_ip", "device", "mode", "allocation_mode", "status",
                            "error", "last_op", "oom", "iteration_times_s"]
