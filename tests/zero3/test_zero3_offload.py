"""DeepSpeed's offload in the ZeRO-3 emulation (zero3.offload_optimizer / offload_param, device
cpu): what DeepSpeed keeps in host memory leaves the device's figures (the allocator model's
allocated peak) and is reported as host bytes beside them; the accounted total keeps it."""
from __future__ import annotations

import pytest

from actors.replay.config import AllocationConfig, ReplayConfig
from actors.replay.engine import ReplayEngine
from actors.replay.memory.reserved_model import ReservedMemoryModel
from actors.replay.memory.target import TargetConfig
from actors.zero3.config import Zero3Config
from actors.zero3.extension import zero3_extensions
from tests.zero3.test_zero3_model_states import llama  # noqa: F401  (the fixture)

WORLD = 4


def _replay(trace, **offload) -> tuple[dict, object]:
    [ext] = zero3_extensions(Zero3Config(strategy="per_module", world_size=WORLD,
                                         param_persistence_threshold=0,
                                         reduce_bucket_size=1000, layout="deepspeed",
                                         **offload), trace)
    model = ReservedMemoryModel(TargetConfig(name="h100_80gb"))
    engine = ReplayEngine(trace, ReplayConfig(
        mode="compute", device="meta", iters=1, warmup_iters=1, measure_memory=False,
        allocation=AllocationConfig(mode="faithful")), extensions=[ext, model])
    try:
        report = engine.run().to_dict()
    finally:
        engine.close()
    assert report["status"] == "ok"
    return {"accounted": report["accounted_peak_bytes"],
            "device": model.model.stats()["predicted_allocated_peak_bytes"],
            "host": model.host_peak_bytes, "report": ext.report()}, ext


@pytest.fixture(scope="module")
def on_device(llama):  # noqa: F811
    return _replay(llama[0])[0]


def test_offload_optimizer_moves_the_optimizer_part_to_the_host(llama, on_device):  # noqa: F811
    offloaded, ext = _replay(llama[0], offload_optimizer={"device": "cpu"})
    b = ext.buffers
    assert on_device["host"] == 0 and b.offload_optimizer
    # fp32 master, moments' upcast, gradient partitions and their fp32 copy, plus the trace's
    # own optimizer-state shards (the moments), all host memory
    state_shards = offloaded["report"]["optimizer_state_bytes"] - b.master_bytes \
        - b.state_upcast_bytes
    assert state_shards > 0 and b.fp32_grad_bytes == b.master_bytes
    held = b.host_bytes + state_shards
    assert b.host_bytes == b.master_bytes + b.state_upcast_bytes + b.grad_partition_bytes \
        + b.fp32_grad_bytes
    assert offloaded["host"] >= held  # the update's shard-sized temporaries on top
    # the device keeps parameters, the reduce bucket and the gradients before reduction:
    # what it gave the host, less the fp32 gradient copy it never had
    assert offloaded["device"] <= on_device["device"] - (held - b.fp32_grad_bytes)
    # no flattened fp32 gradient in the update: the update_* buffers are gone
    assert b.update_flat_grad_bytes == b.update_fp32_grad_bytes == 0
    assert offloaded["report"]["offload_optimizer"] == "cpu"
    # the accounted total (host and device, one memory on a CPU) grows by the fp32 copy at
    # most
    assert on_device["accounted"] <= offloaded["accounted"] \
        <= on_device["accounted"] + b.fp32_grad_bytes


def test_offload_param_moves_the_parameter_shards_to_the_host(llama, on_device):  # noqa: F811
    offloaded, _ = _replay(llama[0], offload_param={"device": "cpu"})
    shards = offloaded["report"]["shard_bytes"]
    assert shards > 0 and offloaded["host"] == shards
    # the device loses the shards (each rounded up to the allocator's 512 B blocks) and gains
    # the gathers' staging copies of this rank's shards, one gather's at a time
    assert offloaded["device"] < on_device["device"]
    assert offloaded["accounted"] >= on_device["accounted"]


def test_offload_devices_are_choices():
    from actors.errors import ConfigError

    with pytest.raises(ConfigError, match="zero3.offload_\\*.device='nvme'"):
        Zero3Config(offload_optimizer={"device": "nvme"})


def test_a_gather_stages_the_host_shards_on_the_device_until_its_wait(llama):  # noqa: F811
    _, ext = _replay(llama[0], offload_param={"device": "cpu"})
    rt, memory = ext.runtime, ext.context.memory
    gather = next(obj for events in ext.z.plan.events.values() for kind, obj in events
                  if kind == "gather" and not obj.backward)
    before = memory.held_bytes
    rt.gather(gather)
    gathered = gather.numel * 2  # bf16
    assert memory.held_bytes - before == gathered + gathered // WORLD  # + this rank's copy
    rt.wait(gather)
    assert memory.held_bytes - before == gathered and not rt.staged
