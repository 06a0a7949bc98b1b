"""experiment=fit_search's layout axis: candidates cheapest first, layouts the recipe cannot
run refused with their reason, the first that fits is the answer and every cheaper one is
reported with why it does not (a stub prober); and on a real tiny job, the answer is the
boundary separate predictions show."""
from __future__ import annotations

import copy
import math

import pytest

from orchestrator.cli.predict import predict_config
from orchestrator.studies.fit_layout import layout_candidates, search_layout, with_layout
from orchestrator.studies.fit_search import run_fit_search
from orchestrator.studies.predict import predict

SMALL = dict(vocab=4096, d_model=512, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=2048,
             seq_len=1024, batch_size=2, activation_checkpointing="none")


def _cfg(cache, capacity: int, world: int = 4, *overrides: str):
    return predict_config("experiment=fit_search", "workload=llama3_8b", f"world_size={world}",
                          f"predict.cache_dir={cache}", "target=custom",
                          f"target.device_memory={capacity}", "target.cuda_context=0",
                          "target.nccl_num_peers=0", "fit_search.axes=[layout]",
                          *[f"workload.{k}={v}" for k, v in SMALL.items()], *overrides)


def test_candidates_are_walked_cheapest_first(tmp_path):
    cfg = _cfg(tmp_path, 1 << 30, 16)
    names = [(c["tp"], c["pp"]) for c in layout_candidates(cfg)]
    assert names[:7] == [(1, 1), (2, 1), (1, 2), (4, 1), (2, 2), (1, 4), (8, 1)]
    assert len(names) == 13  # tp x pp dividing 16 (tp x pp = 16 leaves no FSDP rank: refused)


class _Stub:
    """A prober whose verdicts come from a table (layout name -> fits)."""

    def __init__(self, fitting):
        self.fitting, self.asked = fitting, []

    def fits(self, axis, layout, probes, label=None):
        self.asked.append(label)
        probes.append({"value": label, "verdict": "fits" if label in self.fitting else "oom",
                       "predicted_reserved_peak_bytes": 3 << 30, "usable_capacity_bytes": 2 << 30,
                       "headroom_bytes": -(1 << 30)})
        return label in self.fitting


def test_the_cheapest_fitting_layout_with_the_reasons_of_the_cheaper(tmp_path):
    # n_kv_heads 4: tp 8 cannot split the heads; tp 4 is the first that fits
    cfg = _cfg(tmp_path, 1 << 30, 16)
    stub = _Stub({"dp_shard 4 x tp 4"})
    answer = search_layout(cfg, stub)
    assert answer.best == "dp_shard 4 x tp 4" and answer.reason is None
    assert stub.asked == ["dp_shard 16", "dp_shard 8 x tp 2", "pp 2 x dp_shard 8",
                          "dp_shard 4 x tp 4"]
    assert [o["layout"] for o in answer.others] == stub.asked[:-1]
    assert answer.others[0]["reason"] == "reserved 3.0 GiB of 2.0 GiB usable (headroom -1.0 GiB)"
    refused = search_layout(_cfg(tmp_path, 1 << 30, 16, "fit_search.layout_tp=[1,8]"),
                            _Stub(set()))
    assert refused.best is None and refused.reason == "no candidate layout fits"
    reasons = {o["layout"]: (o["verdict"], o["reason"]) for o in refused.others}
    assert reasons["dp_shard 2 x tp 8"][0] == "refused"
    assert "must be divisible by tp=8" in reasons["dp_shard 2 x tp 8"][1]
    assert "cannot fill 8 pipeline stages" in reasons["pp 8 x dp_shard 2"][1]
    none = search_layout(_cfg(tmp_path, 1 << 30, 16, "fit_search.max_probes=2"), _Stub(set()))
    assert none.best is None and none.reason == "stopped after fit_search.max_probes=2"


def test_a_tiny_job_finds_the_boundary(tmp_path):
    """FSDP alone does not fit where tensor parallel 2 does: the search says so."""
    roomy = _cfg(tmp_path / "cache", 8 << 30, 4, "fit_search.layout_pp=[1]")
    fsdp, tp2 = (predict(copy.deepcopy(with_layout(roomy, {"tp": tp, "pp": 1, "cp": 1})))
                 for tp in (1, 2))
    need = math.ceil(tp2.predicted_reserved_peak_bytes * (1 + roomy.predict.error_band))
    assert fsdp.predicted_reserved_peak_bytes > need, "tp 2 must need less than FSDP alone"
    cfg = _cfg(tmp_path / "cache", need, 4, "fit_search.layout_pp=[1]")
    summary = run_fit_search(cfg, tmp_path / "run", name="small")
    found = summary["answers"]["layout"]
    assert found["best"] == "dp_shard 2 x tp 2" and found["first_failing"] == "dp_shard 4"
    assert [o["layout"] for o in found["others"]] == ["dp_shard 4"]
    assert found["others"][0]["verdict"] != "fits"
    assert summary["job"]["layout"] == "dp_shard 4"
    assert (tmp_path / "run" / "fit_search_layout.png").stat().st_size > 0
