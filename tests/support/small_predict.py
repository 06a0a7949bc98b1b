"""``tracefleet-predict`` of a preset cut down to a small model (world 2 unless told) on an
80 GB target: the comparisons of one knob against the same job without it."""
from __future__ import annotations

from orchestrator.cli.predict import predict_config
from orchestrator.studies.predict import predict
from orchestrator.studies.prediction import Prediction


def predict_small(cache, preset: str, fields: dict, *overrides: str,
                  world_size: int = 2) -> Prediction:
    """The prediction of ``workload=preset`` with ``fields`` and ``overrides`` applied."""
    return predict(predict_config(f"workload={preset}", f"predict.cache_dir={cache}",
                                  f"world_size={world_size}", "target=h100_80gb",
                                  *[f"workload.{k}={v}" for k, v in fields.items()], *overrides))
