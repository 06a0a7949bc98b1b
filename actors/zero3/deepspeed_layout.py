"""DeepSpeed stage 3's own model-state buffers, beside what the trace's optimizer holds
(``zero3.layout=deepspeed``; pure sizes and the boundaries they change at).

Read off DeepSpeed 0.19.8's ``DeepSpeedZeroOptimizer_Stage3`` (runtime/zero/stage3.py), per
rank, for the partitioned parameters (partition = the rank's shard, padded):

* the low-precision partition (the trace's parameter shards, in their dtype: bf16 for a bf16
  run) is what the emulation already holds;
* ``fp32_partitioned_groups_flat``: an fp32 master copy of the partition, made even when the
  parameters are fp32 (its "no copy needed" test compares a ``torch.device`` with a string,
  which is never equal);
* optimizer state on the fp32 master: Adam's moments in fp32 whatever dtype the trace's
  optimizer kept them in (the difference is charged as an upcast);
* ``grad_partitions_flat_buffer``: every gradient partition in one persistent buffer of the
  gradient accumulation dtype (the parameters' dtype unless ``grad_accum_dtype`` is set);
  reduce-scattered gradient shards land in it, so they cost nothing more;
* ``contiguous_gradients``: one reduce bucket buffer of ``reduce_bucket_size`` elements per
  gradient dtype; a ready gradient is copied into it and autograd's tensor freed;
* in the update, ``_prepare_fp32_grad_for_sub_group`` flattens the gradient partitions (a
  new tensor) and converts it to fp32 (another one when gradients are narrower), held
  through the optimizer step.

With ``offload_optimizer`` (device cpu; DeepSpeed sets its ``self.device`` to the host) the
master partition, the moments and the gradient-partition buffer are made in host memory, and
so is a persistent fp32 gradient partition per sub-group (``fp32_partitioned_groups_flat[i]
.grad``), into which the reduced gradients are copied at the accumulation boundary; the update
runs there on it, without the flattened copies. The reduce bucket stays on the device.
"""
from __future__ import annotations

from dataclasses import dataclass

from actors.zero3.states_plan import STATE, ModelState
from actors.zero3.params import Param
from actors.zero3.partition import shard_numel

FP32_BYTES = 4
_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}


@dataclass(frozen=True)
class DeepSpeedBuffers:
    """Bytes of DeepSpeed's own buffers on one rank (see the module docstring)."""

    master_bytes: int  # fp32 master partition (optimizer state)
    state_upcast_bytes: int  # fp32 moments over the trace's narrower ones (optimizer state)
    grad_partition_bytes: int  # grad_partitions_flat_buffer (gradients)
    reduce_bucket_bytes: int  # contiguous-gradients reduce bucket(s) (communication)
    update_flat_grad_bytes: int  # the update's flattened gradient partition (gradients)
    update_fp32_grad_bytes: int  # its fp32 copy when gradients are narrower (gradients)
    # offload_optimizer: the master, moments, gradient partitions and this are host memory
    offload_optimizer: bool = False
    fp32_grad_bytes: int = 0  # offloaded: the persistent fp32 gradient partition (gradients)

    @property
    def persistent_bytes(self) -> int:
        return (self.master_bytes + self.state_upcast_bytes + self.grad_partition_bytes
                + self.reduce_bucket_bytes + self.fp32_grad_bytes)

    @property
    def host_bytes(self) -> int:
        """What of the persistent buffers is host memory (offload_optimizer)."""
        return self.persistent_bytes - self.reduce_bucket_bytes if self.offload_optimizer else 0

    def as_dict(self) -> dict:
        return {"master_bytes": self.master_bytes, "state_upcast_bytes": self.state_upcast_bytes,
                "grad_partition_bytes": self.grad_partition_bytes,
                "reduce_bucket_bytes": self.reduce_bucket_bytes,
                "update_flat_grad_bytes": self.update_flat_grad_bytes,
                "update_fp32_grad_bytes": self.update_fp32_grad_bytes,
                "offload_optimizer": self.offload_optimizer,
                "fp32_grad_bytes": self.fp32_grad_bytes}


def deepspeed_buffers(partitioned: list[Param], states: list[ModelState], world: int,
                      reduce_bucket_size: int, grad_accum_dtype: str | None,
                      offload_optimizer: bool = False) -> DeepSpeedBuffers:
    """DeepSpeed's buffers for ``partitioned`` parameters and the trace's model ``states``;
    ``grad_accum_dtype`` None means each parameter's own dtype (DeepSpeed's default);
    ``offload_optimizer``: its offload_optimizer device is cpu (see the module docstring)."""
    shard = {p.suid: shard_numel(p.numel, world) for p in partitioned}
    total = sum(shard.values())
    grad_itemsize = {p.suid: _ITEMSIZE.get(grad_accum_dtype, p.itemsize) if grad_accum_dtype
                     else p.itemsize for p in partitioned}
    grad_bytes = sum(shard[s] * grad_itemsize[s] for s in shard)
    upcast = sum(m.shard_numel(world) * (FP32_BYTES - m.itemsize) for m in states
                 if m.kind == STATE and m.itemsize < FP32_BYTES and m.numel > 1)
    dtypes = {grad_accum_dtype or p.dtype: grad_itemsize[p.suid] for p in partitioned}
    narrow = sum(shard[s] for s in shard if grad_itemsize[s] < FP32_BYTES)
    return DeepSpeedBuffers(
        master_bytes=total * FP32_BYTES, state_upcast_bytes=upcast, grad_partition_bytes=grad_bytes,
        reduce_bucket_bytes=sum(reduce_bucket_size * size for size in dtypes.values()),
        update_flat_grad_bytes=0 if offload_optimizer else grad_bytes,
        update_fp32_grad_bytes=0 if offload_optimizer else narrow * FP32_BYTES,
        offload_optimizer=offload_optimizer,
        fp32_grad_bytes=total * FP32_BYTES if offload_optimizer else 0)


def update_windows(phase: list[str], update: str) -> list[tuple[int, int]]:
    """``(first op, one past the last)`` of each run of update-phase ops (one per step)."""
    runs: list[tuple[int, int]] = []
    for i, p in enumerate(phase):
        if p != update:
            continue
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs
