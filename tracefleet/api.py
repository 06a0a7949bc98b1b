"""``tracefleet.predict``: does a training job fit a GPU, from Python. The same prediction as
``tracefleet-predict`` (orchestrator/studies/predict.py), composed from the same configs, with
the same capture cache, figures and errors (every one a ``TracefleetError``)::

    from tracefleet import predict

    p = predict("llama3_8b", world_size=8, target="h100_96gb")
    p.fits, p.verdict, p.reserved_peak_bytes, p.headroom_bytes
    print(p.table())
    p.snapshot("llama3_8b.pickle")          # for pytorch.org/memory_viz

``workload`` is a preset name (conf/workload/), ``"PATH.py:FUNCTION"`` or a build function
(actors/capture/workloads/custom.py's contract); ``overrides`` are the command line's keys, with
``__`` for the dots: ``workload__seq_len=4096``, ``predict__error_band=0.05``. Calls from several
threads are safe and run one after another.
"""
from __future__ import annotations

import importlib.util
import inspect
import numbers
import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import orjson

from actors.errors import ConfigError, ReplayError

if TYPE_CHECKING:
    from orchestrator.studies.predict import PredictConfig

# A capture uses process-wide state (torch.distributed's default group, the fake tensor mode,
# patched torch.nn.functional entries): predictions from several threads run one at a time.
_ONE_AT_A_TIME = threading.Lock()


def _entrypoint(build: Callable) -> str:
    """``module:function`` or ``PATH.py:function`` of a build function: the capture loads it
    again from there, so it must be a module-level function."""
    name = getattr(build, "__name__", "")
    if getattr(build, "__qualname__", None) != name or not name.isidentifier():
        raise ConfigError(f"workload={build!r}: a build function must be defined at the top of "
                          "a module (the capture imports it by name), not nested or a lambda")
    module = getattr(build, "__module__", None)
    if module and module != "__main__" and _importable(module):
        return f"{module}:{name}"
    path = inspect.getsourcefile(build)
    if not path or not os.path.isfile(path):
        raise ConfigError(f"workload={build!r}: its source file is unknown; pass "
                          "'PATH.py:FUNCTION' instead")
    return f"{os.path.abspath(path)}:{name}"


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a module loaded from a file by path has no spec
        return False


def _world_size(value) -> int:
    """``value`` as a number of GPUs, as strict as the command line: a whole number >= 1 (not
    a bool, a fraction or a string)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ConfigError(f"world_size={value!r}: expected a whole number of GPUs >= 1")
    return int(value)


def job_config(workload, world_size: int | None, target: str | None, trace_dir,
               overrides: dict) -> "PredictConfig":
    """The config ``predict``'s arguments stand for: the preset choices (workload, target)
    composed by Hydra as the command line composes them, then every value (a custom step's
    entrypoint, the world size, ``trace_dir``, the ``overrides``) applied to that typed config
    as it is: no value is written as override text, so none needs quoting."""
    from orchestrator.cli.predict import predict_config

    values: dict = {}
    if trace_dir is not None:
        choices = []
        values["trace__dir"] = os.fspath(trace_dir)
    elif callable(workload) or (isinstance(workload, str) and ":" in workload):
        choices = ["workload=custom"]
        values["workload__entrypoint"] = _entrypoint(workload) if callable(workload) \
            else workload
    elif isinstance(workload, str):
        choices = [f"workload={workload}"]
    else:
        raise ConfigError(f"workload={workload!r}: expected a preset name, 'PATH.py:FUNCTION' "
                          "or a build function")
    if world_size is not None:
        values["world_size"] = _world_size(world_size)
    if target is not None:
        choices.append(f"target={target}")
    return _with_values(_compose(predict_config, choices), {**values, **overrides})


def _with_values(cfg, values: dict):
    """``cfg`` with ``values`` (``a__b`` keys for ``a.b``) merged into it, checked by its
    schema; OmegaConf's error (an unknown key, a value of the wrong type) as ConfigError."""
    # as in _compose: `import tracefleet` loads no config machinery until the first call
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    nested: dict = {}
    for key, value in values.items():
        *parents, leaf = key.split("__")
        node = nested
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = os.fspath(value) if isinstance(value, os.PathLike) else value
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(cfg), nested))
    except OmegaConfBaseException as e:
        shown = " ".join(f"{k.replace('__', '.')}={v!r}" for k, v in values.items())
        raise ConfigError(f"{shown}: {e}".splitlines()[0]) from None


def predict(workload="llama3_8b", world_size: int | None = None,
            target: str | None = "h100_80gb", *, trace_dir=None, out_dir=None,
            **overrides) -> "Prediction":
    """The prediction for a training job on ``world_size`` GPUs of ``target`` (see the module
    docstring); ``trace_dir``: traces you have instead of a workload; ``out_dir``: also write
    ``prediction.json`` and ``prediction.html`` there (and the snapshots with
    ``predict__snapshot=True``). Raises a ``TracefleetError`` on a user error."""
    # `import tracefleet` stays ~0.1 s: torch and the predictor load at the first call
    from orchestrator.studies.predict import predict as run_prediction

    cfg = job_config(workload, world_size, target, trace_dir, overrides)
    name = workload if isinstance(workload, str) and ":" not in workload and \
        trace_dir is None else None
    with _ONE_AT_A_TIME:
        result = run_prediction(cfg, Path(out_dir) if out_dir is not None else None,
                                name=name).to_dict()
    return Prediction(result, cfg, name, Path(out_dir) if out_dir is not None else None)


def _compose(predict_config, args: list[str]):
    """The config of command-line ``args``, with Hydra's own errors (an unknown key or preset)
    as ConfigError."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        return predict_config(*args)
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError(f"{' '.join(args)}: {e}") from None


class Prediction:
    """One prediction: its figures as attributes, the table, the JSON and the snapshot."""

    def __init__(self, result: dict, cfg, name: str | None, out_dir: Path | None):
        self.result, self._cfg, self._name, self._out_dir = result, cfg, name, out_dir

    @property
    def verdict(self) -> str:
        """``fits``, ``too_close`` (headroom inside the error band) or ``oom``."""
        return self.result["verdict"]

    @property
    def fits(self) -> bool:
        """True only for ``fits``: ``too_close`` fits as predicted but within the error band."""
        return self.verdict == "fits"

    @property
    def reserved_peak_bytes(self) -> int:
        """The caching allocator model's reserved peak (what a CUDA OOM is decided by)."""
        return self.result["predicted_reserved_peak_bytes"]

    @property
    def allocated_peak_bytes(self) -> int:
        return self.result["predicted_allocated_peak_bytes"]

    @property
    def usable_capacity_bytes(self) -> int:
        return self.result["usable_capacity_bytes"]

    @property
    def headroom_bytes(self) -> int:
        """Usable capacity minus the reserved peak (negative: does not fit)."""
        return self.result["headroom_bytes"]

    @property
    def breakdown(self) -> dict[str, int]:
        """The accounted peak's bytes by category (parameters, activations, ...)."""
        return dict(self.result["breakdown"])

    def table(self) -> str:
        """The table ``tracefleet-predict`` prints."""
        from orchestrator.reports.predict_table import prediction_table
        return prediction_table(self.result)

    def to_json(self) -> str:
        """What ``prediction.json`` holds."""
        return orjson.dumps(self.result, option=orjson.OPT_INDENT_2).decode()

    def snapshot(self, path, rank: int | None = None) -> Path:
        """Write the predicted memory snapshot of ``rank`` (default: the rank the figures are
        of) to ``path``, in ``torch.cuda.memory._snapshot()``'s layout. Made with this
        prediction when it wrote snapshots, else by predicting again with the snapshot on (the
        capture is cached: the dry run's time)."""
        rank = self.result["rank"] if rank is None else rank
        path = Path(path)
        written = self.result.get("snapshots") or {}
        if self._out_dir is not None and str(rank) in written:
            shutil.copyfile(self._out_dir / written[str(rank)], path)
            return path
        from orchestrator.studies.predict import predict as run_prediction  # as in predict()

        cfg = self._cfg
        cfg.predict.snapshot = True
        try:
            with tempfile.TemporaryDirectory(prefix="tracefleet-snapshot-") as tmp:
                again = run_prediction(cfg, Path(tmp), name=self._name).to_dict()
                if str(rank) not in again["snapshots"]:
                    raise ConfigError(f"rank {rank}: no snapshot; this prediction replayed "
                                      f"ranks {sorted(map(int, again['snapshots']))}")
                if again["predicted_reserved_peak_bytes"] != self.reserved_peak_bytes:
                    raise ReplayError("the snapshot's dry run predicted another reserved peak "
                                      f"({again['predicted_reserved_peak_bytes']} B, not "
                                      f"{self.reserved_peak_bytes} B): the inputs changed")
                shutil.copyfile(Path(tmp) / again["snapshots"][str(rank)], path)
        finally:
            cfg.predict.snapshot = False
        return path

    def __repr__(self) -> str:
        return (f"Prediction(verdict={self.verdict!r}, reserved_peak_bytes="
                f"{self.reserved_peak_bytes}, headroom_bytes={self.headroom_bytes})")
