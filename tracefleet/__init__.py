"""tracefleet from Python: ``from tracefleet import predict`` (tracefleet/api.py).

The package sits above the driver (``orchestrator``) and the rank side (``actors``); neither
imports it (pyproject's import contracts).
"""
from actors.errors import ConfigError, ReplayError, TraceError, TracefleetError
from tracefleet.api import Prediction, predict

__all__ = ["predict", "Prediction", "TracefleetError", "ConfigError", "TraceError",
           "ReplayError"]
