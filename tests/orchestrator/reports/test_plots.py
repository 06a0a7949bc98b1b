"""Plots that say how sure they are: a sweep's times carry each point's 95% interval."""
from __future__ import annotations

import pandas as pd

from orchestrator.reports.plots import _interval_ms, plot_threshold_sweep
from orchestrator.results import tidy_frame


def _points(with_interval: bool) -> pd.DataFrame:
    rows = []
    for t, (low, high) in zip((1.0, 0.5, 0.25), ((0.09, 0.12), (0.10, 0.11), (None, None))):
        row = {"device_memory_threshold": t, "allocation_mode": "lazy", "status": "ok",
               "peak_memory_bytes": int(t * 1e8), "iteration_time_s": 0.1}
        if with_interval:
            row |= {"iteration_time_ci_low_s": low, "iteration_time_ci_high_s": high}
        rows.append(row)
    return tidy_frame(pd.DataFrame(rows))  # as results.csv is read: nullable dtypes


def test_sweep_times_carry_their_interval(tmp_path):
    low, high = _interval_ms(_points(True))
    assert [round(x, 6) for x in low] == [10.0, 0.0, 0.0]  # 100 ms - 90 ms; none for the last
    assert [round(x, 6) for x in high] == [20.0, 10.0, 0.0]
    assert _interval_ms(_points(False)) == (None, None)
    for with_interval in (True, False):
        path = tmp_path / f"sweep_{with_interval}.png"
        assert plot_threshold_sweep(_points(with_interval), path) and path.stat().st_size > 1000
