"""A run dir's summary.json read without trusting it (summary_file.py)."""
from __future__ import annotations

import sys
from pathlib import Path

import orjson
import pytest

from orchestrator.cli.report import main as report_main
from orchestrator.errors import ResultsError
from orchestrator.reports.summary_file import check_summary, read_summary

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "scripts"))
import fuzz_inputs  # noqa: E402


@pytest.mark.parametrize("path, value, message", [
    (("iteration_time_s",), [0.1], r"iteration_time_s: a list is not a duration in seconds"),
    (("ranks", 0, "iteration_times_s"), {"a": 1}, r"ranks\[0\]\.iteration_times_s: a JSON "
                                                    r"object is not a list of durations"),
    (("ranks", 1, "rank"), "1", r"ranks\[1\]\.rank: '1' is not a rank"),
    (("peak_memory_bytes",), -1, r"peak_memory_bytes: -1 is not a byte count"),
    (("num_flushes",), 2.5, r"num_flushes: 2\.5 is not a count"),
    (("coverage",), "full", r"coverage: 'full' is not a number >= 0"),
    (("ranks", 0, "memory_timeline"), [[1, "x"]], r"ranks\[0\]\.memory_timeline: a list is "
                                                   r"not a memory timeline"),
    (("ranks", 0, "flush_ticks"), [1.5], r"ranks\[0\]\.flush_ticks: a list is not a list of"),
    (("ranks",), {"0": {}}, r"ranks: a JSON object is not a list of rank reports"),
])
def test_a_field_that_is_not_what_its_name_says_is_named(path, value, message):
    summary = fuzz_inputs.base_summary()
    parent = summary
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = value
    with pytest.raises(ResultsError, match=message):
        check_summary(summary, "run/summary.json")


def test_whole_summaries_and_new_fields_pass(tmp_path):
    summary = fuzz_inputs.base_summary()
    summary.update(num_ranks_by_status={"ok": 2}, timings_s={"replay_s": 1.5, "teardown_s": None},
                   iteration_time_stats_s={"min": 0.1}, new_field_of_a_later_version=[1, "a"])
    (tmp_path / "summary.json").write_bytes(orjson.dumps(summary))
    assert read_summary(tmp_path).to_dict()["num_ranks_by_status"] == {"ok": 2}


def test_the_report_names_the_field_in_one_line(tmp_path, capsys):
    summary = fuzz_inputs.base_summary()
    summary["ranks"][0]["iteration_times_s"] = "fast"
    (tmp_path / "summary.json").write_bytes(orjson.dumps(summary))
    assert report_main([str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"tracefleet-report: error: {tmp_path / 'summary.json'}: "
                   "ranks[0].iteration_times_s: 'fast' is not a list of durations in seconds "
                   "(numbers >= 0)")

