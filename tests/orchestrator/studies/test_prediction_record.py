"""The prediction as a record (orchestrator/studies/prediction.py) and its sinks
(orchestrator/studies/prediction_sinks.py): prediction.json is the record's ``to_dict``, read
back whole by ``from_dict``; a sink added to ``predict`` gets the finished prediction, after
prediction.json was written; a sink that fails leaves no prediction.json."""
from __future__ import annotations

import orjson
import pytest

from orchestrator.cli.predict import predict_config
from orchestrator.config import DEMO_TRACES
from orchestrator.errors import ResultsError
from orchestrator.outputs import RunDir
from orchestrator.sinks import Sink
from orchestrator.studies.predict import predict
from orchestrator.studies.prediction import Prediction, read_prediction
from orchestrator.studies.prediction_sinks import PredictionResult, prediction_sinks


class Recorder(Sink[PredictionResult]):
    """Records each step it is handed, with whether prediction.json was there by then."""

    def __init__(self):
        self.seen: list[tuple[str, PredictionResult, bool]] = []

    def _json_written(self, result: PredictionResult) -> bool:
        return result.out_dir is not None and RunDir(result.out_dir).prediction.is_file()

    def write(self, result: PredictionResult) -> None:
        self.seen.append(("write", result, self._json_written(result)))

    def close(self, result: PredictionResult) -> None:
        self.seen.append(("close", result, self._json_written(result)))


def _cfg(*more: str):
    return predict_config(f"trace.dir={DEMO_TRACES / 'gpt_dp_4'}", "target=a100_40gb", *more)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """A prediction of the demo traces into a folder, a recording sink after the files'."""
    out = tmp_path_factory.mktemp("prediction")
    recorder = Recorder()
    p = predict(_cfg("predict.snapshot=true"), out, sinks=[*prediction_sinks(), recorder])
    return out, p, recorder


def test_prediction_json_is_the_records_dict_and_reads_back_whole(written):
    out, p, _ = written
    on_disk = RunDir(out).prediction.read_bytes()
    assert orjson.dumps(p.to_dict(), option=orjson.OPT_INDENT_2) == on_disk
    again = read_prediction(RunDir(out).prediction)
    assert again == p
    assert orjson.dumps(again.to_dict(), option=orjson.OPT_INDENT_2) == on_disk
    # the files the record names were written: the snapshots and the timelines' plot
    assert p.snapshots and all((out / name).is_file() for name in p.snapshots.values())
    assert (out / p.memory_timelines).is_file() and "snapshot_s" in p.timings_s


def test_a_sink_added_gets_the_prediction_after_prediction_json(written):
    out, p, recorder = written
    assert [step for step, _, _ in recorder.seen] == ["write", "close"]
    (_, result, before), (_, same, after) = recorder.seen
    assert result is same and result.prediction is p and result.out_dir == out
    assert set(result.reports) == {int(r) for r in p.snapshots}
    assert not before and after  # prediction.json is written at close, before this sink's


def test_without_a_folder_only_the_sinks_given_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    recorder = Recorder()
    p = predict(_cfg(), sinks=[recorder])
    assert [(step, r.out_dir, r.prediction) for step, r, _ in recorder.seen] == \
        [("write", None, p), ("close", None, p)]
    assert p.snapshots == {} and p.memory_timelines is None
    assert "memory_timelines" not in p.to_dict() and list(tmp_path.iterdir()) == []


def test_a_sink_that_fails_leaves_no_prediction_json(tmp_path):
    class Broken(Sink[PredictionResult]):
        def write(self, result):
            raise OSError("the page could not be written (injected)")

    with pytest.raises(OSError, match="injected"):
        predict(_cfg(), tmp_path, sinks=[*prediction_sinks(), Broken()])
    assert not RunDir(tmp_path).prediction.exists()


@pytest.mark.parametrize("change, message", [
    (lambda d: d.pop("verdict"), r"prediction.json: verdict: missing"),
    (lambda d: d.update(rank="0"), r"prediction.json: rank: '0' is not int"),
    (lambda d: d.update(breakdown=[1]), r"prediction.json: breakdown: a list is not dict"),
    (lambda d: d.update(verdict="maybe"), r"verdict: 'maybe' is not one of fits, too_close"),
    (lambda d: d.update(later_field=1), r"later_field: not a field of a prediction"),
])
def test_a_bad_prediction_json_names_the_file_and_the_field(written, tmp_path, change, message):
    out, _, _ = written
    data = orjson.loads(RunDir(out).prediction.read_bytes())
    change(data)
    path = RunDir(tmp_path).prediction
    path.write_bytes(orjson.dumps(data))
    with pytest.raises(ResultsError, match=message):
        read_prediction(path)
    path.write_bytes(b"[1, 2]")
    with pytest.raises(ResultsError, match="a prediction is a JSON object; this file holds a list"):
        Prediction.from_dict(orjson.loads(path.read_bytes()), path)
