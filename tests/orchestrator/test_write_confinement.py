"""Files tracefleet writes stay inside the folders the user named: a symlink planted where a file
goes is replaced, never written through, and cache folder names are names, never paths."""
from __future__ import annotations

import json
import os

import pytest

from orchestrator.results import atomic_write
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
    from actors.capture.workload_config import WorkloadConfig
    from orchestrator.studies.study_traces import capture_cached

    wl = WorkloadConfig(model="llama", parallel="local", vocab=64, d_model=32, n_layers=1,
                        n_heads=4, seq_len=16, batch_size=1, device="meta")
    cache = tmp_path / "deep" / "cache"
    folder, reused = capture_cached(wl, 1, str(cache), label)
    assert not reused and folder.parent == cache and (folder / "meta.json").is_file()
    assert sorted(p.name for p in tmp_path.rglob("meta.json")) == ["meta.json"]
