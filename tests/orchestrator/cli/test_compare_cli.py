"""`tracefleet-compare`: a recorded snapshot beside a prediction's, its exit codes and output."""
from __future__ import annotations

import json
import os
import pickle

import pytest

from orchestrator.cli.compare import main
from orchestrator.cli.predict import predict_config
from orchestrator.config import DEMO_TRACES
from orchestrator.studies.predict import predict
from tests.support.snapshots import MiB, history


@pytest.fixture(scope="module")
def prediction(tmp_path_factory):
    """A prediction run dir of the demo traces with its snapshots."""
    out = tmp_path_factory.mktemp("predicted")
    predict(predict_config(f"trace.dir={DEMO_TRACES / 'gpt_dp_4'}", "target=a100_40gb",
                           "predict.snapshot=true"), out)
    return out


def test_a_recording_beside_the_prediction(prediction, tmp_path, capsys):
    snap = pickle.loads((prediction / "snapshot_rank0.pickle").read_bytes())
    allocs = [i for i, e in enumerate(snap["device_traces"][0]) if e["action"] == "alloc"]
    k = allocs[200]  # a GPU that allocates 512 B more at the 201st request
    snap["device_traces"][0][k] = {**snap["device_traces"][0][k],
                                   "size": snap["device_traces"][0][k]["size"] + 512}
    recorded = tmp_path / "gpu.pickle"
    recorded.write_bytes(pickle.dumps(snap))
    assert main([str(recorded), str(prediction), "--rank", "0"]) == 0
    out = capsys.readouterr().out
    assert "| reserved peak |" in out and "first divergence: recorded allocation #200" in out
    assert "predicted allocation #200" in out and "node:" in out
    assert main([str(recorded), str(prediction / "snapshot_rank0.pickle"), "--json"]) == 0
    line = json.loads(capsys.readouterr().out)
    assert line["first_divergence"]["recorded"]["index"] == 200
    assert line["lasting_divergence"] is None and line["num_realignments"] == 1


def test_user_errors_exit_2_with_the_file_named(prediction, tmp_path, capsys):
    recorded = tmp_path / "hand.pickle"
    recorded.write_bytes(pickle.dumps(history([(MiB, "a")])))
    assert main([str(recorded), str(tmp_path)]) == 2  # no predicted snapshot there
    assert "no snapshot_rank<r>.pickle here" in capsys.readouterr().err
    assert main([str(recorded), str(prediction), "--rank", "9"]) == 2
    assert "no snapshot of rank 9" in capsys.readouterr().err
    assert main([str(recorded), str(prediction), "--device", "1"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"tracefleet-compare: error: {recorded}: --device 1: it holds the histories of 1 "
        "device(s), 0..0")
    # a cut prediction.json (the rank is read from it) is named, not a traceback
    cut = tmp_path / "cut"
    cut.mkdir()
    for f in prediction.glob("snapshot_rank*.pickle"):
        (cut / f.name).write_bytes(f.read_bytes())
    (cut / "prediction.json").write_bytes((prediction / "prediction.json").read_bytes()[:40])
    assert main([str(recorded), str(cut)]) == 2
    assert f"{cut / 'prediction.json'}: not a whole prediction.json" in capsys.readouterr().err
    assert main([str(recorded), str(cut), "--rank", "0"]) == 0  # --rank needs no prediction.json

    class Evil:
        def __reduce__(self):
            return os.system, ("echo pwned",)

    evil = tmp_path / "evil.pickle"
    evil.write_bytes(pickle.dumps({"segments": [Evil()], "device_traces": []}))
    assert main([str(evil), str(prediction)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"tracefleet-compare: error: {evil}: refused: the pickle asks for ")
    assert "system" in err and "pwned" not in err
