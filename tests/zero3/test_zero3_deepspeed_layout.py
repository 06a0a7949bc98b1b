"""zero3.layout=deepspeed holds what DeepSpeed's stage 3 holds: counted against a real
DeepSpeed ZeRO-3 engine of the same model (2 gloo ranks on cpu)."""
from __future__ import annotations

import json
import os
from datetime import timedelta

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from actors.capture.fake_rank import record_meta_rank
from actors.capture.request import CaptureRequest
from actors.capture.workloads.build import WorkloadConfig, build_workload
from actors.rank_base import free_port
from actors.replay.config import ReplayConfig
from actors.replay.engine import ReplayEngine
from actors.trace import load_trace
from actors.zero3.config import Zero3Config
from actors.zero3.extension import zero3_extensions

WORLD = 2
BUCKET = 30_000
MODEL = dict(vocab=96, d_model=64, n_layers=2, n_heads=4, seq_len=16, batch_size=2)


def _deepspeed_rank(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), DS_ACCELERATOR="cpu")
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=60))
    cfg = WorkloadConfig(kind="llama_zero3", zero3_reduce_bucket_size=BUCKET, **MODEL)
    wl = build_workload(cfg, rank, WORLD)
    wl.step(wl.next_batch())  # the optimizer state exists after a step
    opt = wl.step.engine.optimizer

    def nbytes(tensors):
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    moments = [v for state in opt.optimizer.state.values() for k, v in state.items()
               if k in ("exp_avg", "exp_avg_sq")]
    counts = {"lp": nbytes(opt.fp16_partitioned_groups_flat),
              "master": nbytes(opt.fp32_partitioned_groups_flat),
              "grad_partitions": nbytes([opt.grad_partitions_flat_buffer]),
              "reduce_bucket": nbytes([b.buffer for b in opt.ipg_buckets.values()]),
              "moments": nbytes(moments)}
    if rank == 0:
        with open(out, "w") as f:
            json.dump(counts, f)
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def deepspeed_counts(tmp_path_factory):
    pytest.importorskip("deepspeed")
    out = tmp_path_factory.mktemp("ds") / "counts.json"
    mp.start_processes(_deepspeed_rank, args=(free_port(), str(out)), nprocs=WORLD,
                       start_method="spawn", join=True)
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    folder = tmp_path_factory.mktemp("plain")
    request = CaptureRequest.from_dict({"workload": {"kind": "llama_local", "device": "meta",
                                                     **MODEL}})
    _, path = record_meta_rank(request, str(folder), 0, WORLD)
    trace = load_trace(path)
    [ext] = zero3_extensions(Zero3Config(strategy="per_module", world_size=WORLD,
                                         param_persistence_threshold=0,
                                         reduce_bucket_size=BUCKET), trace)
    report = ReplayEngine(trace, ReplayConfig(mode="compute", device="meta", iters=1,
                                              warmup_iters=0, measure_memory=False),
                          extensions=[ext]).run().to_dict()
    assert report["status"] == "ok", report["error"]
    return ext


@pytest.mark.slow
def test_fp32_states_match_deepspeeds_own_buffers(deepspeed_counts, emulated):
    ds, ext = deepspeed_counts, emulated
    m, b = ext.runtime.metrics, ext.buffers
    assert m.shard_bytes == ds["lp"]
    assert b.master_bytes == ds["master"]  # DeepSpeed copies even fp32 partitions
    assert b.grad_partition_bytes == ds["grad_partitions"]
    assert b.reduce_bucket_bytes == ds["reduce_bucket"]
    trace_moments = m.optimizer_state_bytes - b.master_bytes - b.state_upcast_bytes
    # the trace's AdamW moments as shards (and its one-element step counters)
    assert 0 <= trace_moments + b.state_upcast_bytes - ds["moments"] <= 64


def test_layout_deepspeed_holds_its_buffers_beside_the_trace_layout(emulated, tmp_path):
    ext = emulated
    b = ext.buffers
    assert b.update_fp32_grad_bytes == 0  # fp32 gradients need no conversion
    assert b.update_flat_grad_bytes == b.grad_partition_bytes
    trace = ext.context.trace
    peaks = {}
    for layout in ("trace", "deepspeed"):
        [e] = zero3_extensions(Zero3Config(strategy="per_module", world_size=WORLD,
                                           param_persistence_threshold=0,
                                           reduce_bucket_size=BUCKET, layout=layout), trace)
        report = ReplayEngine(trace, ReplayConfig(mode="compute", device="meta", iters=1,
                                                  warmup_iters=0, measure_memory=False),
                              extensions=[e]).run().to_dict()
        assert report["status"] == "ok", report["error"]
        peaks[layout] = report
    extra = peaks["deepspeed"]["accounted_peak_bytes"] - peaks["trace"]["accounted_peak_bytes"]
    # at least the persistent buffers, at most those plus the update's flat gradients
    assert b.persistent_bytes - b.grad_partition_bytes <= extra
    assert extra <= b.persistent_bytes + b.update_flat_grad_bytes
    ds_breakdown = peaks["deepspeed"]["peak_breakdown"]
    assert ds_breakdown["communication"] >= b.reduce_bucket_bytes
