"""A data-parallel capture of the fine-grained ZeRO-3 study model
(actors/capture/workloads/finegrained_model.py): one recorded step per gloo rank, on the CPU."""
from __future__ import annotations

import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from actors.capture.recorder import record_iteration
from actors.capture.workloads.finegrained_model import FineGrainedConfig, build
from actors.rank_base import free_port
from actors.trace.conventions import trace_file_name


def _capture_rank(rank: int, world: int, port: int, out_dir: str, cfg: FineGrainedConfig,
                  grad_all_reduce: bool = True) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=120))
    model, next_batch = build(cfg, rank)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(batch):
        opt.zero_grad(set_to_none=True)
        model(*batch).backward()
        for p in model.parameters():  # data parallel: one all-reduce per gradient
            if grad_all_reduce:
                dist.all_reduce(p.grad)
            p.grad.div_(world)
        opt.step()

    step(next_batch())  # warm-up: optimizer state exists before the recorded step
    record_iteration(step, next_batch(), model, 1, str(Path(out_dir) / trace_file_name(rank)))
    dist.destroy_process_group()
    # torch 2.13 may abort in C++ static destructors after a gloo + ET run (see
    # tests/support/trace_factory.py); the trace is written: leave without finalization.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def capture_data_parallel(out_dir: Path, world: int, cfg: FineGrainedConfig,
                          grad_all_reduce: bool = True) -> Path:
    """One recorded data-parallel training step per rank in ``out_dir`` (gloo, CPU).
    ``grad_all_reduce=False`` leaves out the gradients' all-reduces (the averaging stays): a
    ZeRO-3 replay of that trace reduce-scatters them itself, as DeepSpeed does, instead of
    also replaying the data-parallel all-reduces."""
    import torch.multiprocessing as mp

    out_dir.mkdir(parents=True, exist_ok=True)
    mp.spawn(_capture_rank, args=(world, free_port(), str(out_dir), cfg, grad_all_reduce),
             nprocs=world)
    return out_dir
