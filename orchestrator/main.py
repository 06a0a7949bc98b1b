"""`tracefleet`: the Hydra app that replays a trace folder on a Ray cluster."""
from __future__ import annotations

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from orchestrator.cli import run_app, user_errors
from orchestrator.config import CONF_DIR, register_configs

register_configs()


@hydra.main(config_path=str(CONF_DIR), config_name="tracefleet", version_base="1.3")
def _app(cfg: DictConfig) -> None:
    from orchestrator.launch import run_replay  # keeps `--help` fast

    with user_errors("tracefleet"):
        run_cfg = OmegaConf.to_object(cfg)
        summary = run_replay(run_cfg, Path(HydraConfig.get().runtime.output_dir),
                             OmegaConf.to_yaml(cfg))
    if summary["status"] != "ok":
        sys.exit(1)


def main() -> None:
    """Console-script entry point (``--debug`` shows tracebacks of user errors)."""
    run_app(_app)


if __name__ == "__main__":
    main()
