"""`tracefleet`: the Hydra app that replays a trace folder on a Ray cluster.

One run replays once (or searches the minimum memory, ``experiment.search=min_memory``, or
runs the OOM study, ``experiment.search=oom_study``) and
exits 0 when its status is ok, 1 otherwise, 2 on a user error. With ``--multirun`` every
point runs and is recorded (orchestrator/studies/sweep.py), and the exit code summarises the sweep.
"""
from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from actors.gc_pause import gc_paused
from orchestrator.cli.app import debugging, print_user_error, run_app, user_errors
from orchestrator.cli.schemas import register_all
from orchestrator.cli.usage import before_hydra
from orchestrator.config import CONF_DIR, Search
from orchestrator.status import RunStatus
from orchestrator.studies import sweep


def run(run_cfg, out_dir: Path, config_yaml: str | None, session=None) -> dict:
    """One run of ``run_cfg`` (a RunConfig) into ``out_dir``; returns its summary."""
    # a sweep point may run in a launcher's worker, where main() never ran: the OOM study
    # composes a workload preset
    register_all()
    # the run's modules import Ray and the replay (seconds): only once a run is composed,
    # which keeps `--help` and a config error fast
    from orchestrator.run.launch import run_replay

    if run_cfg.experiment.search == Search.min_memory:
        from orchestrator.studies.min_memory import run_min_memory
        return run_min_memory(run_cfg, out_dir, config_yaml, session)
    if run_cfg.experiment.search == Search.oom_study:
        from orchestrator.studies.oom_study import run_oom_study
        return run_oom_study(run_cfg, out_dir, config_yaml, session)
    return run_replay(run_cfg, out_dir, config_yaml, session=session)


@hydra.main(config_path=str(CONF_DIR), config_name="tracefleet", version_base="1.3")
def _app(cfg: DictConfig) -> None:
    if sweep.in_multirun():
        with user_errors("tracefleet"):  # a point records its own errors (--debug: raised)
            sweep.run_point(cfg, run, debugging(), partial(print_user_error, "tracefleet"))
        return
    with user_errors("tracefleet"):
        summary = run(OmegaConf.to_object(cfg), Path(HydraConfig.get().runtime.output_dir),
                      OmegaConf.to_yaml(cfg))
    if summary["status"] != RunStatus.ok:
        sys.exit(1)


def main() -> None:
    """Console-script entry point (``--debug`` shows tracebacks of user errors). ``--help``
    and a tracefleet-predict experiment are answered before Hydra starts (usage.py)."""
    code = before_hydra("tracefleet", sys.argv[1:])
    if code is not None:
        sys.exit(code)
    sys.argv[1:] = sweep.with_sweep_dir(sys.argv[1:])
    # the schemas import torch (as tracefleet-predict's and -capture's): after the help, with
    # the cyclic GC off meanwhile (it would rescan torch's objects as they are made)
    with gc_paused():
        register_all()
    try:
        run_app(_app, "tracefleet")
    finally:
        sweep.close_session()  # a sweep stopped by a signal or an error keeps no cluster
    if sweep.last_exit_code is not None:
        sys.exit(sweep.last_exit_code)


if __name__ == "__main__":
    main()
