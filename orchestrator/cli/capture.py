"""`tracefleet-capture`: train a workload on a Ray worker group and record one ET per rank
(the job itself: orchestrator/run/capture.py).

Writes ``rank-<r>.et.json.gz`` and the profiler trace of the same iteration,
``rank-<r>.kineto.json.gz``, for every rank, and ``meta.json`` (world size, workload knobs,
versions, eager iteration times measured without the observer, the original's measured
memory) into ``out_dir``. ``workload.device=meta`` or ``fake`` captures in this process over a
fake process group instead (no Ray, any world size, no timings or memory). Examples::

    tracefleet-capture world_size=4 out_dir=demo/traces/gpt_dp_4
    tracefleet-capture workload.parallel=zero3 workload.leaf_modules=true world_size=2
    tracefleet-capture workload.model=llama workload.parallel=fsdp2 \
        workload.precision=bf16_mixed workload.activation_checkpointing=selective_op world_size=2
    tracefleet-capture workload=llama_70b world_size=8     # meta, seconds
    tracefleet-capture workload=custom workload.entrypoint=examples/fsdp2_llama_step.py:build \
        workload.device=fake world_size=64                # your own step, shapes only
"""
from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig, OmegaConf

from orchestrator.cli.app import run_app, user_errors
from orchestrator.cli.schemas import register_all
from orchestrator.cli.usage import before_hydra
from orchestrator.config import CONF_DIR
from orchestrator.units import human_bytes


@hydra.main(config_path=str(CONF_DIR), config_name="capture", version_base="1.3")
def _app(cfg: DictConfig) -> None:
    # the capture's modules import torch (seconds): only once Hydra composed a config, which
    # keeps --help and a config error fast
    from actors.trace.fake_vs_real import FakeCheck
    from orchestrator.run.capture import run_capture_job
    from orchestrator.run.fake_check import check_lines

    with user_errors("tracefleet-capture"):
        capture_cfg = OmegaConf.to_object(cfg)
        captured = run_capture_job(capture_cfg)
    meta = captured.meta
    print(summary_line(meta, str(captured.folder)))
    check = meta.get("check_fake")
    if check is not None:
        for line in check_lines(FakeCheck.from_dict(check)):
            print(line)
        if not check["equal"]:
            sys.exit(1)


def summary_line(meta: dict, out_dir: str) -> str:
    """The one line the CLI prints: files written, eager time and peak memory where measured."""
    total_kib = sum(r["file_bytes"] for r in meta["ranks"]) / 1024
    line = (f"tracefleet-capture: wrote {meta['world_size']} rank traces ({total_kib:.0f} KiB) "
            f"and meta.json to {out_dir}")
    if meta["iteration_time_s"] is not None:
        line += f"; eager iteration {meta['iteration_time_s'] * 1e3:.1f} ms (median over ranks)"
    if meta["memory"]["peak_bytes"] is not None:
        line += f", peak memory {human_bytes(meta['memory']['peak_bytes'])} (max over ranks)"
    return line


def main() -> None:
    """Console-script entry point (``--debug`` shows tracebacks of user errors); ``--help`` is
    answered first, before torch is imported (usage.py)."""
    code = before_hydra("tracefleet-capture", sys.argv[1:])
    if code is not None:
        sys.exit(code)
    register_all()  # torch: after the help
    run_app(_app, "tracefleet-capture")


if __name__ == "__main__":
    main()
