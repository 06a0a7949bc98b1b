"""Capture small, real Execution Traces in-process for tests (one rank, gloo world of 1)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from actors.rank_base import free_port


class IndexHeavy(nn.Module):
    """Embedding, gather, index_select and a cross-entropy loss: every index-op family."""

    def __init__(self, vocab=50, dim=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.proj = nn.Linear(dim, vocab)
        self.norm = nn.LayerNorm(dim)

    def forward(self, tokens):
        h = self.norm(self.emb(tokens))
        h = torch.index_select(h, 1, torch.arange(h.shape[1] - 1, -1, -1))
        logits = self.proj(F.scaled_dot_product_attention(h, h, h, is_causal=True))
        picked = torch.gather(logits, 2, tokens.unsqueeze(-1) % logits.shape[-1])
        return F.cross_entropy(logits.flatten(0, 1), tokens.flatten()) + picked.mean()


TENSOR_RANGE_ENV = "ENABLE_PYTORCH_EXECUTION_TRACE_SAVE_INTEGRAL_TENSOR_RANGE"


def capture_step(path: Path, with_ranges: bool = True, with_collective: bool = True) -> Path:
    """Record one training step of `IndexHeavy` (after one warm-up step) into ``path``.

    The tensor-range switch is process-wide and read by every later observer: it is put back
    as it was (left on, a later capture of meta tensors loses the inputs that follow an
    integral meta tensor, whose range cannot be read)."""
    saved = os.environ.get(TENSOR_RANGE_ENV)
    if with_ranges:
        os.environ[TENSOR_RANGE_ENV] = "1"
    else:
        os.environ.pop(TENSOR_RANGE_ENV, None)
    try:
        return _capture_step(path, with_collective)
    finally:
        if saved is None:
            os.environ.pop(TENSOR_RANGE_ENV, None)
        else:
            os.environ[TENSOR_RANGE_ENV] = saved


def _capture_step(path: Path, with_collective: bool) -> Path:
    from torch.profiler import ExecutionTraceObserver

    torch.manual_seed(0)
    model = IndexHeavy()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    own_group = with_collective and not dist.is_initialized()
    if own_group:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}",
                                rank=0, world_size=1)

    def step():
        tokens = torch.randint(0, 50, (4, 12))
        loss = model(tokens)
        loss.backward()
        if with_collective:
            for p in model.parameters():
                dist.all_reduce(p.grad)
        opt.step()
        opt.zero_grad()

    try:
        step()
        et = ExecutionTraceObserver()
        et.register_callback(str(path))
        et.start()
        with torch.profiler.record_function("ProfilerStep#1"):
            step()
        et.stop()
        et.unregister_callback()
    finally:
        if own_group:
            dist.destroy_process_group()
    return path


def _rank_main(rank: int, world_size: int, port: int, out_dir: str) -> None:
    from torch.profiler import ExecutionTraceObserver

    os.environ[TENSOR_RANGE_ENV] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size)
    torch.manual_seed(0)
    model = IndexHeavy()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(rank)

    def step():
        model(torch.randint(0, 50, (4, 12), generator=gen)).backward()
        for p in model.parameters():  # data-parallel gradient all-reduce
            dist.all_reduce(p.grad)
        gathered = torch.empty(8 * world_size)
        dist.all_gather_into_tensor(gathered, torch.ones(8))
        dist.broadcast(gathered, src=0)
        opt.step()
        opt.zero_grad()

    step()
    et = ExecutionTraceObserver()
    et.register_callback(f"{out_dir}/rank-{rank}.et.json")
    et.start()
    with torch.profiler.record_function("ProfilerStep#1"):
        step()
    et.stop()
    et.unregister_callback()
    dist.destroy_process_group()
    # torch 2.13 sometimes aborts in C++ static destructors at interpreter exit after a gloo +
    # ET run ("terminate called without an active exception", no Python frame; ~1 in 10 runs
    # on a loaded machine). The trace is complete by now: leave without finalization.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_rank_script(script: str, out_dir: Path, world_size: int, what: str,
                    timeout_s: float = 180) -> Path:
    """Run capture ``script`` as ``world_size`` processes (argv: rank, world size, a free
    port, out_dir) with one intra-op thread each; pytest.fail with their logs if any fails."""
    import subprocess

    import pytest

    path = out_dir / "capture.py"
    path.write_text(script)
    port = str(free_port())
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, str(path), str(r), str(world_size), port,
                               str(out_dir)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              env=env) for r in range(world_size)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout_s)[0].decode(errors="replace"))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    if any(p.returncode != 0 for p in procs):
        pytest.fail(f"{what} failed:\n" + "\n".join(log[-2000:] for log in logs))
    return out_dir


def capture_ranks(out_dir: Path, world_size: int) -> Path:
    """A real ``world_size``-rank gloo data-parallel step, one trace per rank, in ``out_dir``."""
    import torch.multiprocessing as mp

    out_dir.mkdir(parents=True, exist_ok=True)
    mp.spawn(_rank_main, args=(world_size, free_port(), str(out_dir)), nprocs=world_size)
    return out_dir


def et_tail(suffix: str = ".json", warmup: str = "step()", recorded: str = "step()") -> str:
    """The end of a rank capture script whose ``step()`` is defined: ``warmup``, then
    ``recorded`` under the ET observer into ``out/rank-<rank><suffix>``, then exit without
    finalization (torch 2.13 sometimes aborts in C++ static destructors after a gloo + ET run;
    the trace is written by then)."""
    return f"""
{warmup}
et = ExecutionTraceObserver()
et.register_callback(os.path.join(out, f"rank-{{rank}}{suffix}"))
et.start()
{recorded}
et.stop()
et.unregister_callback()
dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)
"""
