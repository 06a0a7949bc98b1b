"""A full disk (ENOSPC, which a write call raises without a file name) is named: the folder and
what was being written, in one line; nothing half-written is left where it would be read as
whole (a prediction.json, a page, a cache entry, a temp file)."""
from __future__ import annotations

import errno
import gzip

import pytest

import actors.capture.recorder as recorder
import actors.atomic_file as atomic_file
import orchestrator.studies.predict as study_predict
import orchestrator.studies.prediction_sinks as prediction_sinks
from actors.errors import writing
from orchestrator.cli.app import user_error_status
from orchestrator.cli.predict import predict_config
from orchestrator.config import DEMO_TRACES


def _full(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_an_unnamed_os_error_gets_the_path_and_what_a_named_one_stays():
    with pytest.raises(OSError) as e:
        with writing("/data/run", "the run's outputs"):
            _full()
    assert (e.value.errno, e.value.filename) == (errno.ENOSPC, "/data/run")
    line = _line(e.value)
    assert line == ("tracefleet: error: cannot use /data/run: No space left on device (writing "
                    "the run's outputs)")
    named = PermissionError(errno.EACCES, "Permission denied", "/data/run/x.csv")
    with pytest.raises(PermissionError) as e:
        with writing("/data/run", "the run's outputs"):
            raise named
    assert e.value is named


def _line(exc) -> str:
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        user_error_status("tracefleet", exc, debug=False)
    return err.getvalue().strip()


def test_atomic_write_on_a_full_disk_leaves_the_old_file_and_no_temp(tmp_path, monkeypatch):
    path = tmp_path / "summary.json"
    path.write_bytes(b'{"old": 1}')

    class FullFile:
        def __init__(self, fd, mode):
            self.f = open(fd, mode)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, data):
            self.f.write(data[:3])  # some bytes got out, then the disk filled
            _full()

    monkeypatch.setattr(atomic_file.os, "fdopen", FullFile)
    with pytest.raises(OSError, match="No space left on device") as e:
        atomic_file.atomic_write(path, b'{"new": 2}')
    assert e.value.filename == str(path)
    assert path.read_bytes() == b'{"old": 1}'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]


def test_a_prediction_on_a_full_disk_names_its_folder_and_writes_no_prediction_json(
        tmp_path, monkeypatch):
    monkeypatch.setattr(prediction_sinks, "write_timelines", _full)
    cfg = predict_config(f"trace.dir={DEMO_TRACES / 'gpt_dp_4'}", "target=a100_40gb")
    out = tmp_path / "out"
    with pytest.raises(OSError) as e:
        study_predict.predict(cfg, out)
    assert _line(e.value) == (f"tracefleet: error: cannot use {out}: No space left on device "
                              "(writing the prediction's files)")
    assert not (out / "prediction.json").exists()


def test_a_rank_trace_on_a_full_disk_is_named(tmp_path, monkeypatch):
    raw = tmp_path / "rank-0.et.json.partial"
    raw.write_bytes(b"{}" * 1000)
    monkeypatch.setattr(recorder.shutil, "copyfileobj", _full)
    out = tmp_path / "rank-0.et.json.gz"
    with pytest.raises(OSError) as e:
        recorder._gzip_to(str(raw), str(out))
    assert e.value.filename == str(out) and "(writing a rank trace)" in e.value.strerror
    monkeypatch.undo()
    recorder._gzip_to(str(raw), str(out))  # with room, the same call writes it
    assert gzip.decompress(out.read_bytes()) == b"{}" * 1000
