"""`tracefleet-predict`: does a training job fit a GPU? Captures the workload on meta or fake
(cached), dry-runs it with the target's caching allocator model and prints one table; writes
``prediction.json`` into the run dir (orchestrator/studies/predict.py). Exit 0 with any verdict (fits,
too_close, oom: a verdict is a result), 2 on a user error. Examples::

    tracefleet-predict workload=llama3_8b world_size=8 target=h100_80gb
    tracefleet-predict workload=llama3_70b world_size=64 target=h100_96gb workload.seq_len=4096
    tracefleet-predict workload=deepspeed_70b world_size=64 target=a100_80gb
    tracefleet-predict workload=custom workload.entrypoint=examples/fsdp2_llama_step.py:build \
        world_size=8 target=custom target.device_memory=24GiB
    tracefleet-predict trace.dir=demo/traces/gpt_dp_4 target=a100_40gb
    tracefleet-predict trace.dir=plain_traces/ world_size=64 zero3=per_module target=a100_80gb
    tracefleet-predict experiment=fit_search workload=llama3_70b world_size=64  # best that fits
"""
from __future__ import annotations

import gc
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from actors.gc_pause import gc_paused
from orchestrator.cli.app import run_app, user_errors
from orchestrator.cli.schemas import register_all
from orchestrator.cli.usage import before_hydra
from orchestrator.config import CONF_DIR, compose
from orchestrator.outputs import FIT_SEARCH_JSON, PREDICTION_HTML

if TYPE_CHECKING:
    from orchestrator.studies.predict import PredictConfig

# torch and the modules that import it are imported by the functions below, inside main()'s
# GC pause: left on, the cyclic GC rescans torch's objects while they are made (~1 s of the
# command's start-up).


def predict_config(*overrides: str) -> PredictConfig:
    """The ``PredictConfig`` the command line ``overrides`` compose to (for scripts, e.g.
    ``predict(predict_config("workload=llama3_8b", "world_size=8"))``)."""
    register_all()
    return OmegaConf.to_object(compose("predict", list(overrides)))


@hydra.main(config_path=str(CONF_DIR), config_name="predict", version_base="1.3")
def _app(cfg: DictConfig) -> None:
    # torch and the predictor (seconds to import) only once Hydra composed a config
    from orchestrator.studies.fit_search_config import FitSearchRunConfig
    from orchestrator.studies.predict import predict
    from orchestrator.studies.prediction_sinks import PredictionConsole, prediction_sinks

    with user_errors("tracefleet-predict"):
        run_cfg = OmegaConf.to_object(cfg)
        hydra_cfg = HydraConfig.get()
        out_dir = Path(hydra_cfg.runtime.output_dir)
        name = hydra_cfg.runtime.choices.get("workload")
        if isinstance(run_cfg, FitSearchRunConfig):
            from orchestrator.studies.fit_search import run_fit_search
            run_fit_search(run_cfg, out_dir, name)
            print(f"fit_search: {out_dir / FIT_SEARCH_JSON}")
            print(f"page: {out_dir / PREDICTION_HTML}  (the job's prediction and the answers)")
            return
        # the files, then the table and where they are: the last lines printed
        predict(run_cfg, out_dir, name=name, sinks=[*prediction_sinks(), PredictionConsole()])


def main() -> None:
    """Console-script entry point (``--debug`` shows tracebacks of user errors). The cyclic GC
    stays off for the whole command: a short-lived process whose capture and dry run already
    pause it (actors/gc_pause.py), and whose imports it would slow. ``--help`` and a
    tracefleet experiment are answered first, before torch is imported (usage.py)."""
    code = before_hydra("tracefleet-predict", sys.argv[1:])
    if code is not None:
        sys.exit(code)
    try:
        with gc_paused():
            register_all()
            run_app(_app, "tracefleet-predict")
    finally:
        # The process ends here: the interpreter's final collection would rescan every object
        # the run made (the trace, the engine, torch's modules; 0.7 s of a 4.3 s cached 8B
        # run) to free them moments before the OS does. Frozen objects are not rescanned.
        gc.freeze()


if __name__ == "__main__":
    main()
