"""Numbers are checked where they enter: a nan or infinite float anywhere in a run's, a
prediction's or a capture's config, and a byte count past any device, are ConfigErrors naming
the key, before any cluster, capture or actor sees them."""
from __future__ import annotations

import pytest

from actors.errors import ConfigError
from actors.replay.config import parse_bytes
from orchestrator.cli.predict import predict_config
from orchestrator.config import RunConfig
from orchestrator.run.capture import CaptureConfig


@pytest.mark.parametrize("override, message", [
    ("predict.capture_timeout_s=nan", "predict.capture_timeout_s=nan: expected a finite number"),
    ("replay.collective_timeout_s=inf", "replay.collective_timeout_s=inf: expected a finite"),
    ("target.device_memory=1e400GiB", "target.device_memory='1e400GiB'; expected a byte count"),
])
def test_a_prediction_refuses(override, message):
    cfg = predict_config("workload=gpt", "world_size=2", "target=custom",
                         "target.device_memory=80GiB", override)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        cfg.validate()


def test_a_run_and_a_capture_refuse_nan_deep_in_their_configs():
    run = RunConfig()
    run.replay.collective_timeout_s = float("nan")
    with pytest.raises(ConfigError, match=r"^replay.collective_timeout_s=nan"):
        run.validate()
    run = RunConfig()
    run.experiment.replay_timeout_s = float("inf")
    with pytest.raises(ConfigError, match=r"^experiment.replay_timeout_s=inf"):
        run.validate()
    capture = CaptureConfig()
    capture.capture_timeout_s = float("nan")
    with pytest.raises(ConfigError, match=r"^capture_timeout_s=nan"):
        capture.validate()
    RunConfig().validate()  # the defaults pass


@pytest.mark.parametrize("value", [True, -1, float("inf"), float("nan"), "1e400GiB", 2 ** 70])
def test_a_byte_count_is_a_byte_count(value):
    with pytest.raises(ConfigError, match="target.x"):
        parse_bytes(value, "target.x")
    assert parse_bytes("80GiB") == 80 << 30 and parse_bytes(1e9) == 10 ** 9
