"""A replay run's result handed to sinks (orchestrator/run/sinks.py) and its summary as a
record (orchestrator/run_summary.py): summary.json is ``RunSummary.to_dict``, read back whole;
a sink added to ``run_replay`` gets the run, its timings final at close; the files-only sinks
(a search's probes) write no page, no plot and print nothing; the default ones print the table
before the outputs listing, last."""
from __future__ import annotations

import io

import orjson
import pytest
from rich.console import Console

from actors.replay.config import AllocationConfig, ReplayConfig
from orchestrator.config import DEMO_TRACES, ClusterConfig, ExperimentConfig, RunConfig, \
    TraceConfig
from orchestrator.outputs import ITERATION_TIMES_PNG, MEMORY_TIMELINE_PNG, REPORT_HTML, RunDir
from orchestrator.reports.summary_file import read_summary
from orchestrator.run.launch import run_replay
from orchestrator.run.sinks import RunResult, default_sinks, file_sinks
from orchestrator.run_summary import RunSummary
from orchestrator.sinks import Sink


class Recorder(Sink[RunResult]):
    """Records each step with the timings the summary had then."""

    def __init__(self):
        self.seen: list[tuple[str, RunResult, set]] = []

    def write(self, result: RunResult) -> None:
        self.seen.append(("write", result, set(result.summary.replayed.timings_s)))

    def close(self, result: RunResult) -> None:
        self.seen.append(("close", result, set(result.summary.replayed.timings_s)))


def _cfg(report: bool = False) -> RunConfig:
    return RunConfig(cluster=ClusterConfig(timeout_s=180),
                     # the smallest demo: two rank actors (their start is the test's time)
                     trace=TraceConfig(dir=str(DEMO_TRACES / "gpt_zero3_leaf_2")),
                     replay=ReplayConfig(mode="compute", device="meta", iters=1, warmup_iters=1,
                                         collective_timeout_s=30,
                                         allocation=AllocationConfig(mode="faithful")),
                     experiment=ExperimentConfig(replay_timeout_s=120, failure_grace_s=3,
                                                 report=report))


def test_files_only_sinks_and_a_custom_one(ray_session, tmp_path, capsys):
    recorder = Recorder()
    summary = run_replay(_cfg(report=True), tmp_path, sinks=[*file_sinks(), recorder])
    assert summary["status"] == "ok", summary["error"]
    # the custom sink: the run's result, whole at write, its timings final at close
    assert [step for step, _, _ in recorder.seen] == ["write", "close"]
    (_, result, at_write), (_, same, at_close) = recorder.seen
    assert result is same and result.out_dir == tmp_path and len(result.rank_reports) == 2
    assert "total_s" not in at_write and {"aggregation_s", "total_s"} <= at_close
    assert result.summary.to_dict() == summary
    # summary.json is the record's dict, and reads back to the same bytes
    on_disk = RunDir(tmp_path).summary.read_bytes()
    option = orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY
    assert orjson.dumps(summary, option=option) == on_disk
    again = RunSummary.from_dict(orjson.loads(on_disk))
    assert orjson.dumps(again.to_dict(), option=option) == on_disk
    assert read_summary(tmp_path).to_dict() == orjson.loads(on_disk)
    assert list(again.to_dict())[:3] == ["status", "world_size", "error"]
    assert "snapshots" in summary and summary["timings_s"]["total_s"] > 0
    # files only: no page (even with experiment.report), no plot, nothing printed
    for name in (REPORT_HTML, MEMORY_TIMELINE_PNG, ITERATION_TIMES_PNG):
        assert not (tmp_path / name).exists(), name
    assert capsys.readouterr().out == ""


@pytest.mark.long
def test_default_sinks_print_the_table_then_write_the_page_then_list_the_outputs(
        ray_session, tmp_path):
    text = io.StringIO()
    console = Console(file=text, width=200)
    run_replay(_cfg(report=True), tmp_path, console=console)
    out = text.getvalue()
    assert (tmp_path / REPORT_HTML).is_file() and (tmp_path / MEMORY_TIMELINE_PNG).is_file()
    table, listing = out.index("tracefleet run: 2 ranks"), out.index("results: ")
    assert table < listing and out.rstrip().splitlines()[-1] == \
        f"page: {tmp_path.resolve() / REPORT_HTML}"
    assert [type(s).__name__ for s in default_sinks(page=False)] == \
        ["RunFiles", "SnapshotFiles", "ConsoleTable", "OutputsListing"]


@pytest.mark.parametrize("data, message", [
    ({"world_size": 2}, r"run/summary.json: status: missing"),
    ({"status": "ok", "world_size": "2"}, r"world_size: '2' is not a number of ranks"),
])
def test_a_summary_without_its_core_is_refused(data, message):
    from orchestrator.errors import ResultsError
    with pytest.raises(ResultsError, match=message):
        RunSummary.from_dict(data, "run/summary.json")
