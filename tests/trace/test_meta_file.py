"""meta.json beside a capture (actors/trace/meta_file.py): the workload fields the OOM study
rebuilds the model from are checked, naming the file and the field (host-gap calibration's
fields are tested in test_host_gaps.py)."""
from __future__ import annotations

import pytest

from actors.errors import TraceError
from orchestrator.studies import study_traces


@pytest.mark.parametrize("text, field", [
    ('{"world_size": 2}', "field 'workload' is missing"),
    ('{"workload": [], "world_size": 2}', "field 'workload' is []"),
    ('{"workload": {}, "world_size": "2"}', 'field \'world_size\' is "2"'),
    ('{"workload": {}, "world_size": 0}', "field 'world_size' is 0"),
    ('{"workload": {}, "world_size": true}', "field 'world_size' is true"),
])
def test_a_malformed_workload_names_the_file_and_field(tmp_path, text, field):
    (tmp_path / "meta.json").write_text(text)
    with pytest.raises(TraceError) as err:
        study_traces.traced_model(tmp_path)
    assert err.value.path == str(tmp_path / "meta.json") and field in str(err.value)


def test_a_ranks_seconds_are_checked_and_absent_means_not_measured(tmp_path):
    from actors.trace.meta_file import rank_seconds

    path = tmp_path / "meta.json"
    meta = {"ranks": [{"rank": 0, "cost_s": 2e-6}, {"rank": 1, "cost_s": None},
                      {"rank": 2, "cost_s": "slow"}]}
    assert rank_seconds(path, meta, 0, "cost_s") == 2e-6
    assert rank_seconds(path, meta, 1, "cost_s") is None  # null: not measured
    assert rank_seconds(path, meta, 3, "cost_s") is None  # no entry for the rank
    with pytest.raises(TraceError, match=r'meta\.json: field ranks\[2\]\.cost_s is "slow"; '
                                         r"expected seconds"):
        rank_seconds(path, meta, 2, "cost_s")
    with pytest.raises(TraceError, match=r"field ranks\[0\] is 7"):
        rank_seconds(path, {"ranks": [7]}, 0, "cost_s")


@pytest.mark.parametrize("rank1, message", [
    ({"iteration_times_s": "fast"}, r'ranks\[1\]\.iteration_times_s is "fast"; expected a list '
                                    r"of seconds \(numbers > 0\)"),
    ({"iteration_times_s": [0.1, -1]}, r"ranks\[1\]\.iteration_times_s is \[0.1,-1\]"),
    ({"profiler_op_cost_s": -1e-7}, r"ranks\[1\]\.profiler_op_cost_s is -1e-7; expected "
                                    r"seconds \(a number >= 0\)"),
    ({"num_threads": "4"}, r'ranks\[1\]\.num_threads is "4"; expected an integer >= 0'),
    ({"machine": "epyc"}, r'ranks\[1\]\.machine is "epyc"; expected an object'),
])
def test_pre_flight_refuses_a_malformed_rank_figure_naming_it(tmp_path, rank1, message):
    """Every rank's figures a replay reads, checked once before any actor starts (they used to
    be read for one rank, or not at all: a "fast" iteration_times_s went unnoticed)."""
    import json
    import shutil

    from actors.trace.meta_file import check_ranks
    from orchestrator.config import DEMO_TRACES
    from orchestrator.preflight.validate import preflight

    folder = tmp_path / "traces"
    shutil.copytree(DEMO_TRACES / "gpt_dp_4", folder)
    meta = json.loads((folder / "meta.json").read_text())
    check_ranks(folder / "meta.json", meta)  # the demo's is well-formed
    meta["ranks"][1].update(rank1)
    (folder / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(TraceError, match=message) as err:
        preflight(str(folder), mode="compute")
    assert err.value.path == str(folder / "meta.json")
    meta["ranks"][1].update({k: None for k in rank1})  # null: not measured, no error
    check_ranks(folder / "meta.json", meta)


def _rank(rank: int, out_dir, **extra) -> dict:
    """What a capture's rank reports (orchestrator/run/capture.py), on fake: nothing measured."""
    return {"rank": rank, "path": f"{out_dir}/rank-{rank}.et.json.gz", "kineto_path": None,
            "file_bytes": 10, "hostname": "h", "num_threads": 1, "iteration_time_s": None,
            "iteration_times_s": None, "peak_memory_bytes": None, "iteration_start_bytes": None,
            "num_params": 7, "torch_version": "2.13.0", "memory_method": None, **extra}


def test_build_meta_reads_back_as_what_the_capture_recorded(tmp_path):
    """build_meta's object, written, is what the readers beside it read: a fake capture's one
    recorded rank written for both, its role's recording, and nothing measured (null times and
    memory; one warm-up, no timed iteration, whatever the settings asked)."""
    import orjson

    from actors.trace.meta_file import build_meta, read_meta, recorded_world_size

    role = dict(recorded_as_rank=0, role="pp0", record_s=1.5, record_peak_rss_bytes=2 << 30,
                record_peak_rss_method="VmHWM", record_pid=42)
    ranks = [_rank(0, tmp_path, **role), _rank(1, tmp_path, **{**role, "role": "pp0"})]
    meta = build_meta(ranks, str(tmp_path), 3.0, world_size=2,
                      workload={"device": "fake", "model": "llama"}, warmup_iters=3,
                      timing_iters=5, module_backward_ranges=True)
    (tmp_path / "meta.json").write_bytes(orjson.dumps(meta))
    back = read_meta(tmp_path / "meta.json")
    assert back == meta and recorded_world_size(tmp_path) == 2
    assert (back["warmup_iters"], back["timing_iters"], back["iteration_time_s"]) == (1, 0, None)
    assert [r["file"] for r in back["ranks"]] == ["rank-0.et.json.gz", "rank-1.et.json.gz"]
    assert back["recorded_rank"] == 0 and back["memory"]["peak_bytes"] is None
    assert [(r["role"], r["rank"], r["peak_rss_bytes"]) for r in back["role_recordings"]] == \
        [("pp0", 0, 2 << 30)]
