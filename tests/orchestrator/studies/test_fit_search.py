"""experiment=fit_search: each axis' answer is the boundary that separately computed predictions
show (the answer fits, the next more ambitious value does not), one results row per probe, a
plot per axis, fit_search.json, and bad input refused (a typo at compose time)."""
from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException

from actors.errors import ConfigError
from orchestrator.studies.fit_search import fit_search, gallop_bisect, run_fit_search
from orchestrator.studies.fit_search_config import FitSearchRunConfig
from orchestrator.outputs import FIT_SEARCH_JSON
from orchestrator.studies.fit_search_report import PROBE
from orchestrator.studies.prediction import Prediction
from orchestrator.studies.predict import predict
from orchestrator.cli.predict import predict_config
from orchestrator.config import REPO_ROOT
from orchestrator.results import ResultsStore

REPO = REPO_ROOT
# llama3_8b's recipe (FSDP2, bf16_mixed, selective_op AC) shrunk: big enough that the reserved
# peak (hundreds of MiB) is not one 20 MiB segment, so it grows with batch, sequence and AC
SMALL = dict(vocab=4096, d_model=512, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=2048,
             seq_len=1024, batch_size=1)
ROOMY = 4 << 30  # a capacity nothing here comes near: the reserved peaks as such


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("fit_search_cache")


def _cfg(cache, capacity: int, *overrides: str) -> FitSearchRunConfig:
    """The small job on 4 GPUs whose usable capacity is exactly ``capacity``."""
    return predict_config("experiment=fit_search", "workload=llama3_8b", "world_size=4",
                          f"predict.cache_dir={cache}", "target=custom",
                          f"target.device_memory={capacity}", "target.cuda_context=0",
                          "target.nccl_num_peers=0",
                          *[f"workload.{k}={v}" for k, v in SMALL.items()], *overrides)


def _predict(cfg: FitSearchRunConfig, axis: str, value) -> Prediction:
    """One prediction of ``cfg`` with ``axis`` set to ``value``, outside the search."""
    cfg = copy.deepcopy(cfg)
    if axis == "world_size":
        cfg.world_size = value
    else:
        setattr(cfg.workload, axis, value)
    return predict(cfg)


def _capacity_fitting(cache, axis: str, value) -> int:
    """The smallest usable capacity at which ``value`` fits with the error band."""
    cfg = _cfg(cache, ROOMY)
    reserved = _predict(cfg, axis, value).predicted_reserved_peak_bytes
    return math.ceil(reserved * (1 + cfg.predict.error_band))


@pytest.mark.parametrize("axis, answer, beyond, overrides", [
    ("batch_size", 3, 4, ["fit_search.max_batch_size=16"]),
    # (at 2048's capacity 2560 fits after alloc retries release cached side-stream segments)
    ("seq_len", 2560, 3072, ["fit_search.seq_len_step=512", "fit_search.max_seq_len=3072"]),
    ("world_size", 2, 1, []),  # the fewest GPUs: one fewer does not fit
    ("activation_checkpointing", "full", "selective_layer", []),  # cheapest that fits
])
def test_each_axis_finds_the_boundary(cache, tmp_path, axis, answer, beyond, overrides):
    capacity = _capacity_fitting(cache, axis, answer)
    cfg = _cfg(cache, capacity, f"fit_search.axes=[{axis}]", *overrides)
    # the boundary as separate predictions at that capacity show it
    assert _predict(cfg, axis, answer).verdict == "fits"
    assert _predict(cfg, axis, beyond).verdict != "fits"

    summary = run_fit_search(cfg, tmp_path, name="small")
    found = summary["answers"][axis]
    assert (found["best"], found["first_failing"], found["reason"]) == (answer, beyond, None)
    rows = ResultsStore(tmp_path).rows()
    assert len(rows) == found["num_probes"] == summary["num_probes"] >= 2
    assert {r["kind"] for r in rows} == {PROBE} and {r["axis"] for r in rows} == {axis}
    assert {r["value"] for r in rows} >= {str(answer), str(beyond)}
    by_value = {r["value"]: r for r in rows}
    assert by_value[str(answer)]["verdict"] == "fits"
    assert by_value[str(answer)]["usable_capacity_bytes"] == capacity
    assert (tmp_path / "results.parquet").is_file() and (tmp_path / found["plot"]).stat().st_size
    assert json.loads((tmp_path / FIT_SEARCH_JSON).read_text())["answers"][axis]["best"] == answer
    # the job's own prediction beside it, its page with the search's plot
    page = (tmp_path / "prediction.html").read_text()
    assert f"<h2>fit_search: {axis}</h2>" in page and page.count("<img ") == 3
    # and the answers as a table: the answer and the first value beyond it, per axis
    assert "<h2>fit_search: best value that fits with the " in page
    assert f"<tr><td>{axis}</td>" in page and f"<td>{answer}</td><td>{beyond}</td>" in page
    assert json.loads((tmp_path / "prediction.json").read_text())["world_size"] == 4


def test_gallop_then_bisect_on_a_known_boundary():
    probed = []

    def fits(v):
        probed.append(v)
        return v <= 37
    values = range(1, 101)
    assert gallop_bisect(values, 0, fits, 20) == (36, 37, None)  # values 37 and 38
    assert probed[:7] == [1, 2, 4, 8, 16, 32, 64]  # doubling, then bisection
    probed.clear()
    assert gallop_bisect(values, 79, fits, 20) == (36, 37, None)  # from 80: halving down
    assert probed[:3] == [80, 40, 20]
    ok, fail, reason = gallop_bisect(values, 0, fits, 3)
    assert (ok, fail) == (3, None) and "max_probes=3" in reason
    assert gallop_bisect(values, 0, lambda v: False, 5) == (None, 0, None)  # nothing fits

    # ends whose peaks the prediction cannot tell apart: no probe spent between them
    probed.clear()
    ok, fail, reason = gallop_bisect(values, 0, fits, 20, lambda a, b: b - a < 10)
    assert (values[ok], values[fail]) == (32, 40) and "within the error band" in reason
    assert probed == [1, 2, 4, 8, 16, 32, 64, 48, 40]  # bisection stopped at 32 | 40
    assert gallop_bisect(values, 0, lambda v: True, 20) == (99, None, None)  # all fits


def test_a_typo_in_an_axis_is_refused_at_compose_time():
    with pytest.raises(ConfigCompositionException) as e:
        predict_config("experiment=fit_search", "world_size=8", "fit_search.axes=[batch_sise]")
    assert "batch_sise" in str(e.value.__cause__) and "batch_size" in str(e.value.__cause__)


@pytest.mark.parametrize("overrides, message", [
    (["fit_search.axes=[]"], "fit_search.axes is empty"),
    (["fit_search.seq_len_step=512", "fit_search.max_seq_len=256"], "no sequence to probe"),
    (["fit_search.max_probes=0"], "fit_search.max_probes=0"),
    (["fit_search.world_sizes=[0,8]"], "fit_search.world_sizes=[0, 8]"),
    (["trace.dir=demo/traces/gpt_dp_4"], "trace.dir"),
])
def test_bad_input_is_a_config_error(overrides, message):
    cfg = predict_config("experiment=fit_search", "world_size=8", *overrides)
    with pytest.raises(ConfigError, match=message.replace("[", r"\[")):
        fit_search(cfg)


def test_cli_prints_a_line_per_probe_and_the_table_and_predicts_the_job_once(cache, tmp_path):
    capacity = _capacity_fitting(cache, "activation_checkpointing", "full")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli.predict", "experiment=fit_search",
         "workload=llama3_8b", "world_size=4", f"predict.cache_dir={cache}", "target=custom",
         f"target.device_memory={capacity}", "target.cuda_context=0", "target.nccl_num_peers=0",
         "fit_search.axes=[activation_checkpointing,batch_size]", "fit_search.max_batch_size=1",
         f"hydra.run.dir={tmp_path}",
         *[f"workload.{k}={v}" for k, v in SMALL.items()]],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    # none, selective_op, selective_layer, full
    assert proc.stdout.count("fit_search activation_checkpointing probe ") == 4
    assert "activation_checkpointing=full -> fits" in proc.stdout
    # batch 1 is the job itself, predicted once already (AC selective_op, which does not fit
    # that capacity): not predicted again
    assert proc.stdout.count("fit_search batch_size probe ") == 1
    assert "activation_checkpointing=selective_op -> fits" not in proc.stdout
    line = next(x for x in proc.stdout.splitlines() if "workload.batch_size=1 -> " in x)
    assert "-> fits" not in line and "the same job as an earlier probe" in line
    assert len(ResultsStore(tmp_path).rows()) == 5
    assert "fit_search: 5 probes (4 predictions)" in proc.stdout
    assert "best that fits" in proc.stdout and (tmp_path / FIT_SEARCH_JSON).is_file()
    assert proc.stdout.splitlines()[-2:] == [f"fit_search: {tmp_path / FIT_SEARCH_JSON}",
                                             f"page: {tmp_path / 'prediction.html'}  (the job's "
                                             "prediction and the answers)"]


def test_axes_searched_side_by_side_answer_as_one_after_another(cache):
    """num_workers=2 (the axes in spawned workers, the job predicted once by the parent) gives
    the same answers and the same probes, each axis' in its order, as the serial search; the
    probes are reported as they finish (the axes interleave), not when an axis ends."""
    capacity = _capacity_fitting(cache, "activation_checkpointing", "selective_op")
    axes = "fit_search.axes=[batch_size,activation_checkpointing]"
    runs = {}
    for workers in (1, 2):
        seen = []
        answers = fit_search(_cfg(cache, capacity, axes, "fit_search.max_batch_size=4",
                                  f"fit_search.num_workers={workers}"), on_probe=seen.append)
        runs[workers] = ([(a.axis, a.best, a.first_failing, a.num_probes) for a in answers],
                         [(r["axis"], str(r["value"]), r["verdict"], r["memoized"],
                           r["predicted_reserved_peak_bytes"]) for r in seen])
    assert runs[2][0] == runs[1][0]
    for axis in ("batch_size", "activation_checkpointing"):
        assert [r for r in runs[2][1] if r[0] == axis] == [r for r in runs[1][1] if r[0] == axis]
    assert runs[1][0][1][:3] == ("activation_checkpointing", "selective_op", "none")
    # the job (batch 1, selective_op) is probed by both axes and predicted once
    job = [r for r in runs[2][1] if r[1] in ("1", "selective_op")]
    assert [r[3] for r in job] == [False, True]
