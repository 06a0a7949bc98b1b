"""Paced, calibrated host gaps (actors/replay/host_gaps.py): the replay's own host time counts
toward a gap, and the profiler's inflation of the recorded host time is taken off."""
from __future__ import annotations

import json
import shutil
import re
import time

import pytest

from actors.replay.config import AllocationConfig, ReplayConfig
from actors.replay.engine import ReplayEngine
from actors.replay.extension_contract import ReplayExtension
from actors.replay.host_gaps import Calibration, HostGaps, profiler_calibration
from actors.trace import load_trace
from actors.trace.kineto import HostTimes
from orchestrator.config import DEMO_TRACES
from tests.support.trace_factory import capture_step

DEMO = DEMO_TRACES


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    return load_trace(capture_step(tmp_path_factory.mktemp("et") / "rank-0.et.json"))


def _cfg():
    return ReplayConfig(mode="compute", device="cpu", iters=2, warmup_iters=0,
                        measure_memory=False, allocation=AllocationConfig(mode="faithful"))


class _Busy(ReplayExtension):
    """Stands for the replay's own host time: busy-waits ``seconds`` before op ``index``."""

    name = "busy"

    def __init__(self, index: int, seconds: float):
        self.index, self.seconds = index, seconds

    def hooks(self):
        def busy():
            end = time.perf_counter() + self.seconds
            while time.perf_counter() < end:
                pass
        return {self.index: [busy]}, {}


def test_paced_gap_spins_only_what_the_replay_did_not_spend(trace):
    gaps, durs = [0.0] * len(trace.ops), [0.0] * len(trace.ops)
    gaps[10] = 0.05
    ext = HostGaps(gaps, "synthetic", op_s=durs)
    engine = ReplayEngine(trace, _cfg(), extensions=[_Busy(5, 0.04), ext])
    r = engine.run().to_dict()
    report = r["host_gaps"]
    assert report["paced"] and report["target_host_s_per_iteration"] == pytest.approx(0.05)
    # 40 ms of the 50 ms window went on the replay's own work: 10 ms are due, and still the
    # iteration takes the original's 50 ms. The spin is measured wall time, so a loaded
    # machine's preemption inside it adds; 10 ms of slack keeps it far from the 50 ms that
    # an unpaced wait spins (CI's run spun 2.5 ms where 2 ms were due)
    assert report["added_s_per_iteration"] <= 0.02
    assert min(r["iteration_times_s"]) >= 0.05


def test_unpaced_gaps_spin_in_full_whatever_the_replay_spent(trace):
    gaps = [0.0] * len(trace.ops)
    gaps[10] = 0.005
    engine = ReplayEngine(trace, _cfg(), extensions=[_Busy(5, 0.003), HostGaps(gaps, "synthetic")])
    report = engine.run().to_dict()["host_gaps"]
    assert not report["paced"] and report["added_s_per_iteration"] >= 0.005


def test_windows_hold_the_gaps_and_the_ops_between_waits(trace):
    n = len(trace.ops)
    gaps, durs = [0.0] * n, [1e-4] * n
    gaps[4], gaps[n - 1] = 0.002, 0.001
    ext = HostGaps(gaps, "synthetic", op_s=durs, calibration=Calibration(scale=0.5))
    ext.attach(ReplayEngine(trace, _cfg()))
    windows = ext.windows_s()
    assert sorted(windows) == [4, n - 1]
    # ops 0-3 before the first wait, 4 to n-2 before the second, collectives excluded
    counted = [i for i in range(n - 1) if trace.ops[i].collective is None]
    assert sum(windows.values()) == pytest.approx(0.5 * (0.003 + 1e-4 * len(counted)))


def _meta(tmp_path, cost_s, rank=0):
    row = {"rank": rank, "iteration_times_s": [0.001]}  # an eager time that must not matter
    if cost_s is not None:
        row["profiler_op_cost_s"] = cost_s
    (tmp_path / "meta.json").write_text(json.dumps({"ranks": [row]}))
    return tmp_path / "rank-0.et.json.gz"


def test_calibration_takes_the_profilers_measured_cost_off_the_host_time(tmp_path):
    host = HostTimes(gaps_s=[0.010, 0.010], op_s=[0.005, 0.005], step_s=0.050, num_events=5000)
    # 5000 events x 2 us = 10 ms of the 30 ms of host time were the profiler's
    cal = profiler_calibration(host, set(), _meta(tmp_path, 2e-6), 0)
    assert cal.calibrated and cal.scale == pytest.approx(1 - 0.010 / 0.030)
    assert "5000 profiled events x 2.000 us = 10.00 ms" in cal.how
    # a collective's own duration is not host time
    cal = profiler_calibration(host, {1}, _meta(tmp_path, 2e-6), 0)
    assert cal.scale == pytest.approx(1 - 0.010 / 0.025)
    # a cost larger than the host time leaves nothing, never a negative wait
    assert profiler_calibration(host, set(), _meta(tmp_path, 1e-3), 0).scale == 0.0


def test_without_the_measured_cost_gaps_are_paced_not_calibrated(tmp_path):
    host = HostTimes(gaps_s=[0.010], op_s=[0.005], step_s=0.050, num_events=100)
    for name, cost_s, rank in (("none", "no meta.json", 0),
                               ("old", None, 0),  # an older meta.json (eager times only)
                               ("other", 2e-6, 3)):  # another rank's figure
        folder = tmp_path / name
        folder.mkdir()
        path = folder / "rank-0.et.json.gz" if name == "none" else _meta(folder, cost_s)
        cal = profiler_calibration(host, set(), path, rank)
        assert (cal.scale, cal.calibrated) == (1.0, False)
        assert cal.how.startswith("not calibrated: no profiler_op_cost_s")


def test_demo_zero3_gaps_are_paced_and_calibrated(tmp_path):
    """The demo's capture, with a profiler cost in its meta.json: less than the recorded
    host time is targeted, by the events times the cost; every window is non-negative."""
    folder = tmp_path / "gpt_zero3_2"
    shutil.copytree(DEMO / "gpt_zero3_2", folder)
    meta = json.loads((folder / "meta.json").read_text())
    for row in meta["ranks"]:
        row["profiler_op_cost_s"] = 0.5e-6
    (folder / "meta.json").write_text(json.dumps(meta))
    demo = load_trace(folder / "rank-0.et.json.gz")
    ext = HostGaps.for_trace(demo)
    ReplayEngine(demo, _cfg(), extensions=[ext])  # attaches it
    collectives = {op.index for op in demo.ops if op.collective is not None}
    recorded = sum(ext.gaps_s) + sum(d for i, d in enumerate(ext.op_s) if i not in collectives)
    events = ext.calibration.num_profiled_events
    assert events > len(demo.ops) / 2  # ops, nested ops and ranges of the profiled step
    assert ext.calibration.calibrated and ext.scale == pytest.approx(1 - events * 0.5e-6 / recorded)
    windows = ext.windows_s()
    assert windows and min(windows.values()) >= 0
    # nothing is left out but the ops after the last wait
    assert sum(windows.values()) == pytest.approx(ext.scale * recorded, rel=0.02)


def test_a_profiler_cost_measured_as_zero_takes_nothing_off(tmp_path):
    """On a loaded machine capture's profiled loop can be no slower than its bare one and
    meta.json holds 0.0 (CI's bench_distributed once refused its own capture for that): a
    measurement, calibrated with nothing taken off."""
    (tmp_path / "meta.json").write_text('{"ranks": [{"rank": 0, "profiler_op_cost_s": 0.0}]}')
    host = HostTimes(gaps_s=[0.010], op_s=[0.005], step_s=0.050, num_events=40)
    cal = profiler_calibration(host, set(), tmp_path / "rank-0.et.json.gz", 0)
    assert cal.calibrated and cal.scale == 1.0 and cal.profiler_op_cost_s == 0.0


@pytest.mark.parametrize("text, field", [
    ("{\"ranks\": [", "invalid JSON"),
    ("[1, 2]", "expected a JSON object"),
    ("{\"world_size\": 2}", "field 'ranks' is missing"),
    ("{\"ranks\": {\"0\": 1}}", "field 'ranks' is"),
    ("{\"ranks\": [{\"rank\": \"0\"}]}", "field ranks[0] is"),
    ("{\"ranks\": [{\"rank\": 0, \"profiler_op_cost_s\": \"fast\"}]}",
     'field ranks[0].profiler_op_cost_s is "fast"'),
    ("{\"ranks\": [{\"rank\": 0, \"profiler_op_cost_s\": -1}]}",
     "field ranks[0].profiler_op_cost_s"),
])
def test_a_malformed_meta_json_is_an_error_naming_the_file_and_field(tmp_path, text, field):
    """Calibration used to be silently off when meta.json was malformed."""
    from actors.errors import TraceError

    (tmp_path / "meta.json").write_text(text)
    host = HostTimes(gaps_s=[0.010], op_s=[0.005], step_s=0.050)
    with pytest.raises(TraceError, match=r"meta\.json: .*" + re.escape(field)):
        profiler_calibration(host, set(), tmp_path / "rank-0.et.json.gz", 0)


def test_a_malformed_meta_json_stops_host_gaps_with_a_replay_error(tmp_path):
    """Through the extension: a ReplayError naming replay.host_gaps, the file and the field."""
    import shutil

    from actors.errors import ReplayError

    for name in ("rank-0.et.json.gz", "rank-0.kineto.json.gz"):
        shutil.copy(DEMO / "gpt_dp_4" / name, tmp_path / name)
    (tmp_path / "meta.json").write_text('{"ranks": [{"rank": 0, "profiler_op_cost_s": [1]}]}')
    with pytest.raises(ReplayError, match=r"host_gaps=true: .*meta\.json: field "
                                          r"ranks\[0\]\.profiler_op_cost_s"):
        HostGaps.for_trace(load_trace(tmp_path / "rank-0.et.json.gz"))


def test_an_oversized_meta_json_is_refused(tmp_path, monkeypatch):
    from actors.errors import TraceError
    from actors.trace import meta_file

    monkeypatch.setattr(meta_file, "MAX_META_BYTES", 100)
    (tmp_path / "meta.json").write_text(json.dumps({"ranks": [], "pad": "x" * 200}))
    with pytest.raises(TraceError, match=r"meta\.json: expands past the limit of 100 bytes"):
        meta_file.read_meta(tmp_path / "meta.json")
