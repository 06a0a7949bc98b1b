"""Executes the model-state events of one rank (actors/zero3/states_plan.py): optimizer-state
shards, full gradients turned into shards by reduce-scatter, shard-sized update temporaries.

Every model state is a storage the ZeRO-3 extension owns: the engine neither accounts nor
frees it; this runtime does. Optimizer state is allocated once as flat shards, its trace views
bound to them, so the step's ops run on shards. A gradient is charged full-size right before
the op that makes it; at its bucket's reduce-scatter its shard is allocated and filled, its
views are rebound to the shard and the full gradient is dropped. With a process group the
bucket is one real ``reduce_scatter`` (rank-major, as DeepSpeed's reduce_scatter_coalesced lays
it out, then averaged); without one (compute mode, an emulated world) this rank's slice of its
own gradient stands in for the reduced shard. A temporary is charged shard-sized right before
the op that makes it: its inputs are shards, so the op makes it shard-sized.
"""
from __future__ import annotations

import time

import torch

from actors.replay.comm.calls import RS_ONE
from actors.replay.ops.resolve import torch_dtype
from actors.replay.memory.tensor_store import FLOAT_FILL
from actors.trace.categories import COMMUNICATION, GRADIENTS, OPTIMIZER_STATE, TEMPORARIES
from actors.zero3.deepspeed_layout import DeepSpeedBuffers
from actors.zero3.metrics import Zero3Metrics
from actors.zero3.states_plan import GRAD, STATE, Bucket, ModelState, StatesPlan
from actors.zero3.fetch_runtime import view_stride

# torch 2.13 renamed reduce_scatter_tensor (the old name warns on every call)


def _nbytes(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()


class ModelStatesRuntime:
    """Shards and full gradients of one rank; ``run(events)`` executes one boundary's events."""

    def __init__(self, plan: StatesPlan, world: int, rank: int, device: torch.device, store,
                 memory, metrics: Zero3Metrics, views: dict[int, list], group=None,
                 buffers: DeepSpeedBuffers | None = None, host: bool = False):
        self.plan, self.world, self.rank, self.device = plan, world, rank, device
        # DeepSpeed's offload_optimizer: optimizer state, gradient shards and the update's
        # temporaries are host memory (charged as such); full gradients stay the device's
        self.host = host
        self.store, self.memory, self.metrics, self.group = store, memory, metrics, group
        self.views = views  # suid -> its TensorArgs (one per tensor uid)
        self.state_shards: dict[int, torch.Tensor] = {}  # suid -> optimizer-state shard
        # gradients and temporaries held now: charged bytes, and whether it is a shard
        self.held: dict[ModelState, tuple[int, bool]] = {}
        # zero3.layout=deepspeed: DeepSpeed's own buffers (gradient shards live in its
        # gradient-partition buffer, so they cost nothing more)
        self.buffers = buffers
        self.ds_persistent: list[tuple] = []  # (buffer, category, host)
        self.update_held: list[tuple] = []  # the update's flat gradients, as ds_persistent

    # --- set-up ---------------------------------------------------------------------------
    def allocate(self) -> None:
        """Optimizer-state shards, charged once and bound."""
        for m in self.plan.of_kind(STATE):
            shard = self._empty(m.shard_numel(self.world), m.dtype)
            self.memory.charge(_nbytes(shard), OPTIMIZER_STATE, self.host)
            self.metrics.optimizer_state_bytes += _nbytes(shard)
            self.state_shards[m.suid] = shard
        self.bind_states()
        if self.buffers is not None:
            b, host = self.buffers, self.buffers.offload_optimizer
            for nbytes, category, on_host in (
                    (b.master_bytes + b.state_upcast_bytes, OPTIMIZER_STATE, host),
                    (b.grad_partition_bytes, GRADIENTS, host),
                    (b.fp32_grad_bytes, GRADIENTS, host),
                    (b.reduce_bucket_bytes, COMMUNICATION, False)):
                if nbytes:
                    self.ds_persistent.append(self._charged_bytes(nbytes, category, on_host))
            self.metrics.optimizer_state_bytes += b.master_bytes + b.state_upcast_bytes

    def bind_states(self) -> None:
        """Every view of an optimizer state is its flat shard (the step runs element-wise)."""
        bind = self.store.bind
        for suid, shard in self.state_shards.items():
            for v in self.views[suid]:
                bind(v, shard)

    # --- events ---------------------------------------------------------------------------
    def run(self, events: list[tuple[str, object]]) -> None:
        for kind, obj in events:
            getattr(self, kind)(obj)

    def grad_full(self, g: ModelState) -> None:
        """Before the op that makes gradient ``g``: its full size is held until reduced. A
        gradient that existed before the iteration (accumulated into) gets its full tensor."""
        self.memory.charge(g.nbytes, GRADIENTS)
        self.metrics.add_grad_full(g.nbytes)
        self.held[g] = (g.nbytes, False)
        if g.external:
            full = self._empty(g.numel, g.dtype)
            for v in self.views[g.suid]:
                self.store.bind(v, torch.as_strided(full, v.shape, view_stride(v), v.offset))

    def to_bucket(self, g: ModelState) -> None:
        """DeepSpeed's contiguous gradients: ready gradient ``g`` is copied into the reduce
        bucket's buffer (held for good) and autograd's tensor is freed; its data stays bound
        for the reduce-scatter."""
        nbytes, is_shard = self.held.get(g, (0, True))
        if is_shard:
            return
        self.memory.discharge(nbytes, GRADIENTS)
        self.metrics.add_grad_full(-nbytes)
        self.held[g] = (0, False)

    def update_begin(self, _=None) -> None:
        """DeepSpeed's update flattens the gradient partitions and converts them to fp32."""
        b = self.buffers
        for nbytes in (b.update_flat_grad_bytes, b.update_fp32_grad_bytes):
            self.update_held.append(self._charged_bytes(nbytes, GRADIENTS))

    def update_end(self, _=None) -> None:
        """After the optimizer step: the flat gradients go."""
        for x, category, host in self.update_held:
            self.memory.discharge(_nbytes(x), category, host)
        self.update_held.clear()

    def temp(self, t: ModelState) -> None:
        """Before the op that makes update temporary ``t``: its shard size."""
        nbytes = t.shard_bytes(self.world)
        self.memory.charge(nbytes, TEMPORARIES, self.host)
        self.metrics.add_scratch(nbytes)
        self.held[t] = (nbytes, True)

    def reduce_scatter(self, bucket: Bucket) -> None:
        """Each gradient of ``bucket`` becomes its shard (see the module docstring)."""
        t0 = time.perf_counter()
        fulls = [self._full_of(g) for g in bucket.grads]
        if self.group is not None:
            shards = self._reduce_scatter(bucket, fulls)
        else:
            shards = [self._local_slice(g, full) for g, full in zip(bucket.grads, fulls)]
        for g, shard in zip(bucket.grads, shards):
            self._to_shard(g, shard)
        m = self.metrics
        m.num_reduce_scatters += 1
        m.reduce_scatter_bytes += sum(g.nbytes for g in bucket.grads)
        m.reduce_scatter_s += time.perf_counter() - t0

    def release(self, m: ModelState) -> None:
        """After the last use of a gradient shard or a temporary."""
        held = self.held.pop(m, None)
        if held is None:
            return
        nbytes, is_shard = held
        self.store.unbind(m.suid)
        self.memory.discharge(nbytes, GRADIENTS if m.kind == GRAD else TEMPORARIES,
                              self.host and (is_shard or m.kind != GRAD))
        if m.kind != GRAD:
            self.metrics.add_scratch(-nbytes)
        elif is_shard:
            self.metrics.add_grad_shard(-nbytes)
        else:
            self.metrics.add_grad_full(-nbytes)

    def drop_all(self) -> None:
        """Release every gradient and temporary still held (the end of an iteration, or one
        that stopped half-way); optimizer-state shards stay."""
        for m in list(self.held):
            self.release(m)
        self.update_end()

    # --- helpers --------------------------------------------------------------------------
    def _to_shard(self, g: ModelState, shard: torch.Tensor) -> None:
        nbytes = 0 if self.buffers is not None else _nbytes(shard)  # in the partition buffer
        self.memory.charge(nbytes, GRADIENTS, self.host)
        self.metrics.add_grad_shard(nbytes)
        full_bytes, _ = self.held[g]
        self.store.unbind(g.suid)
        self.memory.discharge(full_bytes, GRADIENTS)
        self.metrics.add_grad_full(-full_bytes)
        self.held[g] = (nbytes, True)
        for v in self.views[g.suid]:
            self.store.bind(v, shard)

    def _full_of(self, g: ModelState) -> torch.Tensor | None:
        """The full gradient as a flat tensor of its storage (None: no op made it, e.g. its
        maker was skipped)."""
        if self.device.type == "meta":
            return None
        tensors = self.store.tensors
        for v in self.views[g.suid]:
            x = tensors[v.uid]
            if x is not None:
                try:  # storage_offset is absolute: the whole storage from any view of it
                    return torch.as_strided(x, (g.numel,), (1,), 0)
                except RuntimeError:  # the op made a smaller storage than the trace's
                    return x.reshape(-1)
        return None

    def _local_slice(self, g: ModelState, full: torch.Tensor | None) -> torch.Tensor:
        """This rank's slice of its own gradient, zero-padded: the reduce-scatter's output
        without the other ranks' contributions."""
        s = g.shard_numel(self.world)
        shard = self._empty(s, g.dtype, fill=full is None)
        if full is not None:
            piece = full[self.rank * s:(self.rank + 1) * s]
            shard[:piece.numel()].copy_(piece)
            shard[piece.numel():].zero_()
        return shard

    def _reduce_scatter(self, bucket: Bucket, fulls: list) -> list[torch.Tensor]:
        """One reduce-scatter of the bucket over the process group: rank r's input row holds
        the r-th slice of every gradient (zero-padded), so its output is its shards."""
        world = self.world
        sizes = [g.shard_numel(world) for g in bucket.grads]
        dtype = bucket.grads[0].dtype
        rows = self._empty(world * sum(sizes), dtype, fill=False).view(world, sum(sizes))
        out = self._empty(sum(sizes), dtype, fill=False)
        self.memory.charge(_nbytes(rows) + _nbytes(out), COMMUNICATION)
        col = 0
        for g, full, s in zip(bucket.grads, fulls, sizes):
            block = rows[:, col:col + s]
            if full is None:
                block.fill_(FLOAT_FILL)
            else:
                block.zero_()  # DeepSpeed's padding
                _copy_padded(block, full, s)
            col += s
        RS_ONE(out, rows.reshape(-1), group=self.group)
        out.div_(world)  # DeepSpeed averages gradients over the data-parallel ranks
        shards = [piece.clone() for piece in out.split(sizes)]
        self.memory.discharge(_nbytes(rows) + _nbytes(out), COMMUNICATION)
        return shards

    def _charged_bytes(self, nbytes: int, category: int,
                       host: bool = False) -> tuple[torch.Tensor, int, bool]:
        """A buffer of ``nbytes`` really allocated (measured on cpu) and charged."""
        self.memory.charge(nbytes, category, host)
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device), category, host

    def _empty(self, numel: int, dtype: str, fill: bool = True) -> torch.Tensor:
        x = torch.empty(numel, dtype=torch_dtype(dtype), device=self.device)
        if fill and self.device.type != "meta":
            x.fill_(FLOAT_FILL)
        return x


def _copy_padded(block: torch.Tensor, full: torch.Tensor, s: int) -> None:
    """``block[r]`` = elements [r*s, (r+1)*s) of ``full`` (what lies past its end stays)."""
    n, world = full.numel(), block.shape[0]
    whole = min(n // s, world)  # rows entirely inside the gradient
    if whole:
        block[:whole].copy_(full[:whole * s].view(whole, s))
    if whole < world and n > whole * s:
        block[whole, :n - whole * s].copy_(full[whole * s:])
