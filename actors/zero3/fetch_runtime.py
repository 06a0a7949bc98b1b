"""Executes a ZeRO-3 plan's events on one rank: shards, all-gathers, binding, release.

Shards are allocated once (``allocate``) and charged to the engine's memory; each all-gather
allocates its gathered buffer (charged), fills this rank's slot from the shards and, with a
process group, issues ``all_gather_into_tensor`` asynchronously; without one (an emulated
world, compute mode) the other ranks' slots are filled locally instead, timed as the wait.
Waiting binds the parameters' trace views to the gathered data: views into the buffer
(``single``, ``flat``) or per-parameter copies out of it (``rank_major``, after which the
buffer is dropped). Releasing unbinds and discharges. The update phase binds every view of
a parameter to its flat shard (``scratch``): the optimizer steps the shard, element-wise.

hpZ (``hpz`` ranks per group > 1, ZeRO++'s hierarchical partitioning): releasing a home
gathered in forward keeps this rank's 1/hpz of it (the secondary shard); a backward gather
of homes that all have one runs within the rank's group of ``hpz`` consecutive ranks (one
node when ranks are ordered by node, as tracefleet orders them). ``drop_secondary`` frees
them before the optimizer step changes the parameters.
"""
from __future__ import annotations

import time

import torch

from actors.replay.comm.calls import AG_ONE
from actors.replay.ops.resolve import torch_dtype
from actors.replay.memory.tensor_store import FLOAT_FILL
from actors.trace.categories import COMMUNICATION, PARAMETERS, TEMPORARIES
from actors.zero3.metrics import Zero3Metrics
from actors.zero3.params import Param
from actors.zero3.partition import flat_offsets, flat_shard, param_shard, reassemble, shard_numel
from actors.zero3.fetch_schedule import Gather, Home


# torch 2.13 renamed all_gather_into_tensor (the old name warns on every call)


def _nbytes(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()


def view_stride(v) -> tuple:
    """A view's strides (contiguous ones where the trace has none)."""
    if v.stride is not None and len(v.stride) == len(v.shape):
        return v.stride
    return torch.empty(v.shape, device="meta").stride()


class Zero3Runtime:
    """Shards and gathered buffers of one rank; ``run(events)`` is the body of every hook."""

    def __init__(self, homes: list[Home], world: int, rank: int, device: torch.device,
                 store, memory, group=None, init_full=None, hpz: int = 1, hpz_group=None,
                 host_shards: bool = False, host_update: bool = False):
        self.homes, self.world, self.rank, self.device = homes, world, rank, device
        # DeepSpeed's offload_param: the partitioned shards are host memory, each gather
        # copies this rank's to the device first; offload_optimizer: the update (its
        # shard-sized scratch) runs in host memory
        self.host_shards, self.host_update = host_shards, host_update
        self.staged: dict[int, int] = {}  # gather id -> bytes of its shards' device copy
        self.store, self.memory, self.group = store, memory, group
        self.hpz, self.hpz_group = hpz, hpz_group  # ranks per secondary group, its group
        # init_full(param) -> its full values (tests); default: the store's constant fill
        self.init_full = init_full
        self.shards: dict[Home, torch.Tensor] = {}
        self.secondary: dict[Home, torch.Tensor] = {}
        # gathered homes: (charged bytes, padded buffer); scratch ones: (bytes, [full, ...])
        self.held: dict[Home, tuple[int, object]] = {}
        self.inflight: dict[int, tuple[torch.Tensor, object, int]] = {}  # id -> (out, work, ranks)
        self.scratched: set[Home] = set()
        self.forward_gathered: set[Home] = set()
        self.metrics = Zero3Metrics()
        # per home: (param, element offset in its gathered buffer), and per parameter its
        # views as (TensorArg, shape, stride, offset): computed once, bound at every fetch
        self._offsets = {h: list(zip(h.params, flat_offsets([p.numel for p in h.params], world)[0]))
                         for h in homes}
        self._views = {p.suid: [(v, v.shape, view_stride(v), v.offset) for v in p.views]
                       for h in homes for p in h.params}
        # the home holding each partitioned parameter's shard (the update binds to it)
        self._shard_home = {p.suid: h for h in homes if not h.persistent for p in h.params}

    # --- set-up ---------------------------------------------------------------------------
    def allocate(self) -> None:
        """Shards of every partitioned home; persistent parameters whole (and bound)."""
        m = self.metrics
        for h in self.homes:
            if h.persistent:
                full = self._full(h.params[0])
                self.memory.charge(_nbytes(full), PARAMETERS)
                m.persistent_bytes += _nbytes(full)
                self.held[h] = (0, full)
                continue
            if h.flat:
                numel = flat_offsets([p.numel for p in h.params], self.world)[1] // self.world
            else:
                numel = shard_numel(h.params[0].numel, self.world)
            shard = torch.empty(numel, dtype=torch_dtype(h.dtype), device=self.device)
            if self.init_full is not None:
                fulls = [self._full(p) for p in h.params]
                shard.copy_(flat_shard(fulls, self.world, self.rank) if h.flat
                            else param_shard(fulls[0], self.world, self.rank))
            elif self.device.type != "meta":
                shard.fill_(FLOAT_FILL)
            self.shards[h] = shard
            self.memory.charge(_nbytes(shard), PARAMETERS, self.host_shards)
            m.shard_bytes += _nbytes(shard)
        self.bind_persistent()

    def bind_persistent(self) -> None:
        """(Re)bind persistent parameters: they stay gathered for the whole replay."""
        for h, (_, full) in self.held.items():
            if h.persistent:
                self._bind(h.params[0], full)

    def _full(self, p: Param) -> torch.Tensor:
        if self.init_full is not None:
            return self.init_full(p).reshape(-1).to(self.device)
        x = torch.empty(p.numel, dtype=torch_dtype(p.dtype), device=self.device)
        if self.device.type != "meta":
            x.fill_(FLOAT_FILL)
        return x

    # --- events ---------------------------------------------------------------------------
    def run(self, events: list[tuple[str, object]]) -> None:
        """Execute one boundary's events in order."""
        t0 = time.perf_counter()
        for kind, obj in events:
            getattr(self, kind)(obj)
        self.metrics.bubble_s += time.perf_counter() - t0

    def gather(self, g: Gather) -> None:
        t0 = time.perf_counter()
        m = self.metrics
        local = self.hpz > 1 and g.backward and all(h in self.secondary for h in g.homes)
        ranks, rank, group, sources = (self.hpz, self.rank % self.hpz, self.hpz_group,
                                       self.secondary) if local else \
            (self.world, self.rank, self.group, self.shards)
        out = torch.empty(g.numel, dtype=torch_dtype(g.homes[0].dtype), device=self.device)
        self.memory.charge(_nbytes(out), COMMUNICATION)
        chunk = g.numel // ranks
        slot = out[rank * chunk:(rank + 1) * chunk]
        if self.host_shards and not local:  # the host shards' device copy, until the wait
            self.staged[g.id] = _nbytes(slot)
            self.memory.charge(_nbytes(slot), COMMUNICATION)
        if len(g.homes) > 1:
            torch.cat([sources[h] for h in g.homes], out=slot)
        else:
            slot.copy_(sources[g.homes[0]])
        work = None
        if group is not None:
            work = AG_ONE(out, slot, group=group, async_op=True)
        self.inflight[g.id] = (out, work, ranks)
        m.num_allgathers += 1
        m.num_allgathers_intra_group += local
        m.allgather_bytes += _nbytes(out)
        m.add_gathered(_nbytes(out))
        m.fetch_host_s += time.perf_counter() - t0

    def wait(self, g: Gather) -> None:
        out, work, ranks = self.inflight.pop(g.id)
        m = self.metrics
        t0 = time.perf_counter()
        if work is not None:
            work.wait()
        elif self.device.type != "meta" and ranks > 1:
            out.fill_(FLOAT_FILL)  # the other ranks' slots, standing in for the transfer
        t1 = time.perf_counter()
        m.wait_s += t1 - t0
        staged = self.staged.pop(g.id, 0)
        if staged:
            self.memory.discharge(staged, COMMUNICATION)
        if g.kind == "rank_major":
            numels = [h.params[0].numel for h in g.homes]
            for h, padded in zip(g.homes, reassemble(out, numels, ranks, self.world)):
                self._hold(h, padded, _nbytes(padded))
                self._bind(h.params[0], padded[:h.params[0].numel])
            self.memory.discharge(_nbytes(out), COMMUNICATION)
            m.add_gathered(-_nbytes(out))
        else:
            h = g.homes[0]
            self._hold(h, out, 0)
            for p, offset in self._offsets[h]:
                self._bind(p, out, offset)
        if not g.backward:
            self.forward_gathered.update(g.homes)
        m.fetch_host_s += time.perf_counter() - t1

    def _hold(self, h: Home, padded: torch.Tensor, charge: int) -> None:
        """``padded`` now holds home ``h`` (``charge`` more bytes than the gathered buffer)."""
        if charge:
            self.memory.charge(charge, COMMUNICATION)
            self.metrics.add_gathered(charge)
        self.held[h] = (_nbytes(padded), padded)

    def release(self, h: Home) -> None:
        t0 = time.perf_counter()
        if self.hpz > 1 and h in self.forward_gathered and h not in self.secondary:
            padded = self.held[h][1]
            chunk = padded.numel() // self.hpz
            r = self.rank % self.hpz
            self.secondary[h] = sec = padded[r * chunk:(r + 1) * chunk].clone()
            self.memory.charge(_nbytes(sec), PARAMETERS)
            self.metrics.add_secondary(_nbytes(sec))
        self.forward_gathered.discard(h)
        self._drop(h)
        self.metrics.release_host_s += time.perf_counter() - t0

    def drop_secondary(self, _=None) -> None:
        for sec in self.secondary.values():
            self.memory.discharge(_nbytes(sec), PARAMETERS)
            self.metrics.add_secondary(-_nbytes(sec))
        self.secondary.clear()

    def scratch(self, h: Home) -> None:
        """The update phase steps this rank's shard, as ZeRO-3 does: every view of the
        parameter is its flat shard (the optimizer's ops are element-wise), no memory more. A
        parameter whose shard lies in a leaf unit's flat shard gets a shard-sized scratch."""
        p = h.params[0]
        home = self._shard_home[p.suid]
        if home.flat:
            shard = torch.empty(shard_numel(p.numel, self.world), dtype=torch_dtype(p.dtype),
                                device=self.device)
            if self.device.type != "meta":
                shard.fill_(FLOAT_FILL)
            nbytes = _nbytes(shard)
            self.memory.charge(nbytes, TEMPORARIES, self.host_update)
            self.metrics.add_scratch(nbytes)
        else:
            shard, nbytes = self.shards[home], 0
        self.held[h] = (nbytes, shard)
        self.scratched.add(h)
        for v in p.views:
            self.store.bind(v, shard)

    def unscratch(self, h: Home) -> None:
        self._drop(h)

    def _drop(self, h: Home) -> None:
        for p in h.params:
            self.store.unbind(p.suid)
        nbytes, _ = self.held.pop(h)
        if h in self.scratched:
            self.scratched.discard(h)
            self.memory.discharge(nbytes, TEMPORARIES, self.host_update)
            self.metrics.add_scratch(-nbytes)
        else:
            self.memory.discharge(nbytes, COMMUNICATION)
            self.metrics.add_gathered(-nbytes)

    def _bind(self, p: Param, data: torch.Tensor, offset: int = 0) -> None:
        """Every trace view of ``p`` over ``data``, whose element ``offset`` is the first of
        ``p``'s storage."""
        base = data.storage_offset() + offset
        bind = self.store.bind
        for v, shape, stride, off in self._views.get(p.suid) or \
                [(v, v.shape, view_stride(v), v.offset) for v in p.views]:
            bind(v, torch.as_strided(data, shape, stride, base + off))

    def drop_all(self) -> None:
        """Release whatever an interrupted iteration left gathered (persistent ones stay)."""
        for out, work, _ in self.inflight.values():
            if work is not None:
                work.wait()
            self.memory.discharge(_nbytes(out), COMMUNICATION)
            self.metrics.add_gathered(-_nbytes(out))
        self.inflight.clear()
        for staged in self.staged.values():
            self.memory.discharge(staged, COMMUNICATION)
        self.staged.clear()
        for h in [h for h in self.held if not h.persistent]:
            self._drop(h)
        self.forward_gathered.clear()
        self.drop_secondary()
