"""tracefleet-predict with FSDP2's CPU offload (workload.cpu_offload): parameter shards, their
gradients and the optimizer state are host memory, not the GPU's; the device figures drop by
them and the host bytes are reported beside."""
from __future__ import annotations

import pytest

from actors.capture.workloads.config import WorkloadConfig, validate
from actors.errors import ConfigError
from orchestrator.reports.predict_table import prediction_table
from tests.support.small_predict import predict_small

TINY = dict(vocab=2048, d_model=256, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=512,
            seq_len=64, batch_size=1, activation_checkpointing="none")


def _predict(cache, *overrides):
    return predict_small(cache, "llama3_8b", TINY, *overrides)


def test_offloaded_states_leave_the_device_figures(tmp_path):
    on_gpu = _predict(tmp_path)
    offloaded = _predict(tmp_path, "workload.cpu_offload=true")
    states = sum(offloaded.breakdown[c] for c in ("parameters", "optimizer_state"))
    assert offloaded.host_peak_bytes >= states > 0 and on_gpu.host_peak_bytes == 0
    # the device keeps what it computes with; the fp32 shards, moments and gradients left it
    assert offloaded.predicted_allocated_peak_bytes <= \
        on_gpu.predicted_allocated_peak_bytes - states
    assert offloaded.target["usable_capacity_bytes"] == on_gpu.target["usable_capacity_bytes"]
    assert "| host memory (offloaded) |" in prediction_table(offloaded.to_dict())
    assert "host memory" not in prediction_table(on_gpu.to_dict())
    # the job line names the knob: the two jobs are told apart by it
    first = [prediction_table(p.to_dict()).splitlines()[0] for p in (offloaded, on_gpu)]
    assert ", CPU offload)" in first[0]
    assert "CPU offload" not in first[1]


def test_offload_is_fsdp2s():
    with pytest.raises(ConfigError, match="cpu_offload=true is FSDP2's CPUOffloadPolicy"):
        validate(WorkloadConfig(model="llama", parallel="ddp", cpu_offload=True))


def test_deepspeed_offload_optimizer_leaves_the_device_figures(tmp_path):
    """DeepSpeed's offload_optimizer in the ZeRO-3 emulation: the fp32 master partition,
    moments and gradient partitions are host bytes; the device's allocated peak drops."""
    def run(*overrides):
        return predict_small(tmp_path, "deepspeed_70b", TINY,
                             "workload.zero3_emulation.param_persistence_threshold=0",
                             "workload.zero3_emulation.reduce_bucket_size=100000", *overrides,
                             world_size=8)

    on_gpu = run()
    offloaded = run("workload.zero3_emulation.offload_optimizer.device=cpu")
    assert on_gpu.host_peak_bytes == 0
    ds = offloaded.zero3_emulation
    assert ds["offload_optimizer"]["device"] == "cpu"
    moved = offloaded.host_peak_bytes
    assert moved > 0
    # most of what moved was the device's (the fp32 gradient copy and the update's
    # temporaries are the host's own)
    drop = on_gpu.predicted_allocated_peak_bytes - offloaded.predicted_allocated_peak_bytes
    assert drop > moved / 2
    assert "| host memory (offloaded) |" in prediction_table(offloaded.to_dict())


def test_deepspeeds_offload_knobs_are_its_own():
    from actors.capture.workloads.zero3 import _offload_sections

    with pytest.raises(ConfigError, match="zero3_offload_optimizer=cpu is DeepSpeed's offload"):
        validate(WorkloadConfig(model="llama", parallel="fsdp2", zero3_offload_optimizer="cpu"))
    cfg = WorkloadConfig(model="llama", parallel="zero3", zero3_offload_param="cpu")
    assert _offload_sections(cfg) == {"offload_param": {"device": "cpu"}}


def test_offloaded_activations_leave_the_device_figures(tmp_path):
    """workload.activation_offload: every tensor saved for backward is a host copy from forward
    on (actors/capture/workloads/activation_offload.py); backward copies each back to the
    device while its node runs. The host copies are host bytes; the device keeps the rest."""
    on_gpu = _predict(tmp_path, "workload.seq_len=256", "workload.batch_size=4")
    offloaded = _predict(tmp_path, "workload.seq_len=256", "workload.batch_size=4",
                         "workload.activation_offload=true")
    assert on_gpu.host_peak_bytes == 0
    # what was saved for backward (and more: save_on_cpu copies the saved weights too)
    assert offloaded.host_peak_bytes >= on_gpu.breakdown["activations"] > 0
    saved = on_gpu.breakdown["activations"]
    assert offloaded.predicted_allocated_peak_bytes <= \
        on_gpu.predicted_allocated_peak_bytes - saved // 2
    assert "activations offloaded" in prediction_table(offloaded.to_dict()).splitlines()[0]


@pytest.mark.parametrize("overrides,message", [
    (dict(parallel="zero3", precision="bf16_mixed"), "parallel=zero3"),
    (dict(activation_checkpointing="full"), "activation_checkpointing=full"),
    (dict(model="custom", entrypoint="examples/ddp_step.py:build"), "model=custom")])
def test_activation_offload_is_refused_where_the_hooks_do_not_wrap_the_step(overrides, message):
    with pytest.raises(ConfigError, match=rf"workload.activation_offload=true with .*{message}"):
        validate(WorkloadConfig(**{"model": "llama", "activation_offload": True, **overrides}))


ROWS, WIDTH, NUM_LAYERS = 1024, 256, 4


def build_partly_offloaded(ctx, offload: bool = True):
    """A custom step whose first two layers run under save_on_cpu (unless not ``offload``) and
    the rest outside it."""
    from contextlib import nullcontext

    import torch
    import torch.nn as nn

    layers = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU()) for _ in range(NUM_LAYERS)]
    net = nn.Sequential(*layers).to(ctx.device)
    optimizer = torch.optim.AdamW(net.parameters())

    def step(batch):
        with torch.autograd.graph.save_on_cpu(pin_memory=True) if offload else nullcontext():
            h = net[:2](batch)
        net[2:](h).sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return net, lambda: torch.randn(ROWS, WIDTH, device=ctx.device), step


def build_on_device(ctx):
    """The same step without save_on_cpu."""
    return build_partly_offloaded(ctx, offload=False)


def _custom(cache, build: str):
    from orchestrator.cli.predict import predict_config
    from orchestrator.studies.predict import predict

    return predict(predict_config(
        "workload=custom", f"workload.entrypoint={__file__}:{build}",
        f"predict.cache_dir={cache}", "world_size=1", "target=h100_80gb"))


def test_a_steps_own_save_on_cpu_keeps_exactly_what_it_saved_in_host_memory(tmp_path):
    """A GPU target's capture names the copies a save_on_cpu region made as host memory
    (actors/capture/fake/host_copies.py): the two layers inside it saved their matmul's input
    and GELU's input, and the second its weight (the first layer's input needs no gradient, so
    neither does its weight's copy); the two layers outside stay on the device."""
    offloaded = _custom(tmp_path, "build_partly_offloaded")
    activation, weight = ROWS * WIDTH * 4, WIDTH * WIDTH * 4
    host = 4 * activation + weight
    assert offloaded.host_peak_bytes == host
    rows = {r["op"]: r for r in offloaded.kernel_dispatch}
    copies = rows["torch.autograd.graph.save_on_cpu"]
    assert (copies["num_calls"], copies["kept_bytes"]) == (5, host)
    # the device holds them no more: against the same step without the region
    on_device = _custom(tmp_path, "build_on_device")
    assert on_device.host_peak_bytes == 0
    drop = on_device.predicted_allocated_peak_bytes - offloaded.predicted_allocated_peak_bytes
    # (3 of the 4.25 MiB at the device's peak: backward's copies back are the device's)
    assert drop >= host // 2
