"""Files tracefleet writes stay inside the folders the user named: a symlink planted where a file
goes is replaced, never written through, and cache folder names are names, never paths."""
from __future__ import annotations

import json
import os

import pytest

from actors.atomic_file import atomic_write
from tests.capture.test_capture_meta import meta_capture


def test_a_symlink_planted_as_meta_json_is_replaced_not_written_through(tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("not tracefleet's")
    out = tmp_path / "capture"
    out.mkdir()
    (out / "meta.json").symlink_to(outside)
    meta_capture(out, 2)
    assert outside.read_text() == "not tracefleet's"
    assert not (out / "meta.json").is_symlink()
    assert json.loads((out / "meta.json").read_text())["world_size"] == 2


def test_atomic_write_does_not_follow_a_planted_temp_file(tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("keep")
    target = tmp_path / "table.csv"
    (tmp_path / f".table.csv.{os.getpid()}.tmp").symlink_to(outside)
    with pytest.raises(OSError):
        atomic_write(target, b"rows")
    assert outside.read_text() == "keep" and not target.exists()


@pytest.mark.parametrize("label", ["../workload/gpt", "/etc/passwd", ".."])
def test_a_cache_label_that_is_a_path_names_a_folder_inside_the_cache(tmp_path, label):
    from actors.capture.workloads.config import WorkloadConfig
    from orchestrator.studies.study_traces import capture_cached

    wl = WorkloadConfig(model="llama", parallel="local", vocab=64, d_model=32, n_layers=1,
                        n_heads=4, seq_len=16, batch_size=1, device="meta")
    cache = tmp_path / "deep" / "cache"
    capture, reused = capture_cached(wl, 1, str(cache), label)
    folder = capture.folder
    assert not reused and folder.parent == cache and (folder / "meta.json").is_file()
    assert sorted(p.name for p in tmp_path.rglob("meta.json")) == ["meta.json"]


def _plant(folder, names: list[str], outside) -> list:
    """A symlink to ``outside`` at each of ``names`` under ``folder``."""
    links = []
    for name in names:
        link = folder / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(outside)
        links.append(link)
    return links


def _written_by(run) -> list[str]:
    """Every file a first run wrote under its folder (relative names)."""
    return sorted(str(p.relative_to(run)) for p in run.rglob("*") if p.is_file())


def test_a_prediction_into_a_folder_with_planted_links_writes_through_none(tmp_path):
    """Every file a prediction writes (prediction.json and page, its PNGs, the timelines'
    CSVs, the snapshots) planted as a link in an out_dir given again: none is followed."""
    from orchestrator.cli.predict import predict_config
    from orchestrator.config import DEMO_TRACES
    from orchestrator.studies.predict import predict

    cfg = predict_config(f"trace.dir={DEMO_TRACES / 'gpt_dp_4'}", "target=a100_40gb",
                         "predict.snapshot=true")
    first = tmp_path / "first"
    predict(cfg, first)
    names = _written_by(first)
    assert {"prediction.json", "prediction.html", "snapshot_rank0.pickle"} <= set(names)
    assert any(n.endswith(".png") for n in names) and any(n.endswith(".csv") for n in names)
    outside = tmp_path / "outside.txt"
    outside.write_text("not tracefleet's")
    again = tmp_path / "again"
    links = _plant(again, names, outside)
    predict(cfg, again)
    assert outside.read_text() == "not tracefleet's"
    assert not [str(p) for p in links if p.is_symlink()]


def test_a_report_into_a_run_dir_with_planted_links_writes_through_none(tmp_path):
    """tracefleet-report writes into a folder that exists (the run dir): its page and every
    plot planted as a link there are replaced, not written through."""
    from orchestrator.reports.html_report import write_report
    from tests.orchestrator.reports.test_html_report import _run_dir

    run = _run_dir(tmp_path / "run")
    write_report(run)
    names = [n for n in _written_by(run) if n != "summary.json"]
    assert "report.html" in names and any(n.endswith(".png") for n in names)
    for name in names:
        (run / name).unlink()
    outside = tmp_path / "outside.txt"
    outside.write_text("not tracefleet's")
    links = _plant(run, names, outside)
    write_report(run)
    assert outside.read_text() == "not tracefleet's"
    assert not [str(p) for p in links if p.is_symlink()]


def test_run_outputs_replace_planted_links(tmp_path):
    """A run dir is made fresh by every run (cli/app.py unique_run_dir); its writers replace a
    link all the same (summary.json, ranks.csv and .parquet, config.yaml, timelines)."""
    from orchestrator.reports.run_report import write_run_outputs
    from orchestrator.run.aggregate import aggregate
    from tests.orchestrator.reports.test_metrics_report import ok_report

    reports = [ok_report(0, 0.1), ok_report(1, 0.2)]
    first = tmp_path / "first"
    write_run_outputs(aggregate(reports, world_size=2), reports, first, "a: 1\n")
    names = _written_by(first)
    assert {"summary.json", "ranks.csv", "ranks.parquet", "config.yaml"} <= set(names)
    outside = tmp_path / "outside.txt"
    outside.write_text("not tracefleet's")
    again = tmp_path / "again"
    links = _plant(again, names, outside)
    write_run_outputs(aggregate(reports, world_size=2), reports, again, "a: 1\n")
    assert outside.read_text() == "not tracefleet's"
    assert not [str(p) for p in links if p.is_symlink()]
