"""The capture machine against the replay machine (actors/machine.py)."""
from __future__ import annotations

import json

from rich.console import Console

from actors.machine import machine_info, replay_machine_warnings
from orchestrator.reports.run_report import print_summary

HERE = {"cpu_model": "Xeon X", "num_cpus": 2, "num_threads": 1, "gpu": None}


def _folder(tmp_path, machines):
    (tmp_path / "meta.json").write_text(json.dumps(
        {"ranks": [{"rank": r, "machine": m} for r, m in enumerate(machines)]}))
    return tmp_path


def test_this_machine_is_described():
    info = machine_info()
    assert info["cpu_model"] and info["num_cpus"] >= 1 and info["num_threads"] >= 1


def test_same_machine_no_warning(tmp_path):
    folder = _folder(tmp_path, [HERE, HERE])
    assert replay_machine_warnings(folder, [{"rank": 0, "machine": HERE},
                                            {"rank": 1, "machine": HERE}]) == []


def test_another_cpu_or_thread_count_is_named_per_rank(tmp_path):
    folder = _folder(tmp_path, [HERE, HERE])
    other = {**HERE, "cpu_model": "EPYC Y", "num_threads": 4}
    warnings = replay_machine_warnings(folder, [{"rank": 0, "machine": HERE},
                                                {"rank": 1, "machine": other}])
    assert len(warnings) == 1 and warnings[0].startswith("rank 1 replays on another machine")
    assert "cpu_model: 'Xeon X' at capture, 'EPYC Y' here" in warnings[0]
    assert "num_threads: 1 at capture, 4 here" in warnings[0]
    console = Console(record=True, width=300)
    print_summary({"ranks": [], "machine_warnings": warnings}, console=console)
    assert "warning: rank 1 replays on another machine" in console.export_text()


def test_a_subset_of_ranks_is_compared_with_the_traces_it_replays(tmp_path):
    other = {**HERE, "num_cpus": 64}
    folder = _folder(tmp_path, [HERE, HERE, other])
    # replay rank 0 replays trace rank 2 (trace.ranks=[2]): captured on the 64-CPU machine
    assert replay_machine_warnings(folder, [{"rank": 0, "machine": other}], [2]) == []
    (warning,) = replay_machine_warnings(folder, [{"rank": 0, "machine": HERE}], [2])
    assert "num_cpus: 64 at capture, 2 here" in warning


def test_older_capture_without_a_machine_says_it_cannot_compare(tmp_path):
    folder = _folder(tmp_path, [None])
    (warning,) = replay_machine_warnings(folder, [{"rank": 0, "machine": HERE}])
    assert "records no capture machine" in warning
    assert replay_machine_warnings(tmp_path / "no-such-folder", [{"rank": 0}]) == []


def test_ranks_with_the_same_difference_share_one_warning(tmp_path):
    folder = _folder(tmp_path, [HERE] * 6)
    other = {**HERE, "num_threads": 2}
    reports = [{"rank": r, "machine": other if r != 3 else HERE} for r in range(6)]
    (warning,) = replay_machine_warnings(folder, reports)
    assert warning.startswith("ranks 0-2, 4-5 replay on another machine than they were")
    assert "num_threads: 1 at capture, 2 here" in warning
