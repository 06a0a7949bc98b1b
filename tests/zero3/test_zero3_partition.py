"""ZeRO-3 partitioning: DeepSpeed's padding, and shards that all-gather back into every
parameter exactly, over real gloo groups of 2 and 4 ranks, for every gather layout, in
forward (world group) and in backward from hpZ's node-group shards; a bucket of gradients
reduce-scattered into each rank's averaged shards."""
from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from actors.rank_base import free_port
from actors.trace.model import TensorArg
from actors.zero3.metrics import Zero3Metrics
from actors.zero3.states_plan import GRAD, Bucket, ModelState, StatesPlan
from actors.zero3.params import Param
from actors.zero3.partition import aligned_numel, flat_offsets, shard_numel
from actors.zero3.fetch_schedule import Gather, Home
from actors.zero3.fetch_runtime import Zero3Runtime
from actors.zero3.states_runtime import ModelStatesRuntime

# (shape, stride, storage offset) of each parameter's view; numels 7, 12, 1, 30 and 5 (a view
# at offset 2 of a 7-element storage): divisible by neither 2 nor 4, so padding is exercised.
SHAPES = [((7,), (1,), 0), ((3, 4), (4, 1), 0), ((1,), (1,), 0), ((5, 6), (6, 1), 0),
          ((5,), (1,), 2)]
STORAGE_NUMEL = [7, 12, 1, 30, 7]


class FakeStore:
    """What the runtime needs of the engine's TensorStore: bind/unbind by uid and suid."""

    def __init__(self):
        self.bound: dict[int, tuple[int, torch.Tensor]] = {}

    def bind(self, t, x):
        self.bound[t.uid] = (t.suid, x)

    def unbind(self, suid):
        self.bound = {u: v for u, v in self.bound.items() if v[0] != suid}


class FakeMemory:
    def __init__(self):
        self.held_bytes = 0

    def charge(self, n, category=None, host=False):
        self.held_bytes += n

    def discharge(self, n, category=None, host=False):
        self.held_bytes -= n


def make_params() -> list[Param]:
    params = []
    for k, ((shape, stride, offset), numel) in enumerate(zip(SHAPES, STORAGE_NUMEL)):
        view = TensorArg(100 + k, 200 + k, offset, 0, 4, "cpu", shape, stride, "float32")
        view.uid, view.suid = k, k
        params.append(Param(suid=k, index=k, numel=numel, dtype="float32", itemsize=4,
                            tensor_ids=(100 + k,), views=[view]))
    return params


def full_values(p: Param) -> torch.Tensor:
    """Distinct values per parameter and element (the same on every rank)."""
    return torch.arange(p.numel, dtype=torch.float32) + 1000.0 * (p.index + 1)


def expected_view(p: Param) -> torch.Tensor:
    v = p.views[0]
    return torch.as_strided(full_values(p), v.shape, v.stride, v.offset)


def test_padding_matches_deepspeed():
    assert [aligned_numel(n, 4) for n in (1, 4, 5, 30)] == [4, 4, 8, 32]
    assert [shard_numel(n, 64) for n in (1, 64, 65, 4096)] == [1, 1, 2, 64]
    assert flat_offsets([7, 12, 1], 4) == ([0, 8, 20], 24)


def _rank_main(rank: int, world: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))
    try:
        hpz = 2  # ZeRO++ groups of 2 consecutive ranks
        node_groups = [dist.new_group([k, k + 1]) for k in range(0, world, hpz)]
        params = make_params()
        single = [Home(k, [p]) for k, p in enumerate(params)]
        flat = Home(len(params), params, flat=True)
        store, memory = FakeStore(), FakeMemory()
        rt = Zero3Runtime(single + [flat], world, rank, torch.device("cpu"), store, memory,
                          dist.group.WORLD, full_values, hpz, node_groups[rank // hpz])
        rt.allocate()
        shard_bytes = memory.held_bytes
        assert shard_bytes == 4 * (sum(shard_numel(n, world) for n in STORAGE_NUMEL)
                                   + flat_offsets(STORAGE_NUMEL, world)[1] // world)
        units = [("single", [h]) for h in single] + [("rank_major", single), ("flat", [flat])]
        for k, (kind, homes) in enumerate(units):
            numel = sum(h.gathered_numel(world) for h in homes)
            # forward over the world; backward over the node group, from the secondary shards
            # the forward release kept
            for backward in (False, True):
                g = Gather(2 * k + backward, homes, kind, "t", numel, backward)
                rt.run([("gather", g), ("wait", g)])
                for p in (p for h in homes for p in h.params):
                    got = store.bound[p.views[0].uid][1]
                    assert torch.equal(got, expected_view(p)), (world, kind, backward, p)
                rt.run([("release", h) for h in homes])
                assert store.bound == {}, (world, kind)
            secondary = sum(4 * h.gathered_numel(world) // hpz for h in homes)
            assert memory.held_bytes == shard_bytes + secondary, (world, kind)
            rt.run([("drop_secondary", None)])
            assert memory.held_bytes == shard_bytes
        assert rt.metrics.num_allgathers == 2 * len(units)
        assert rt.metrics.num_allgathers_intra_group == len(units)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # 2 and 4 spawned gloo ranks
@pytest.mark.parametrize("world", [2, 4])
def test_partition_and_gather_reconstruct_every_parameter(world):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_rank_main, args=(world, free_port()), nprocs=world, join=True)


class RegistryStore:
    """What the model-state runtime needs of the engine's TensorStore: a registry by uid."""

    def __init__(self, uids_by_suid: dict[int, list[int]]):
        self.tensors: list = [None] * (1 + max(u for us in uids_by_suid.values() for u in us))
        self.uids_by_suid = uids_by_suid

    def bind(self, t, x):
        self.tensors[t.uid] = x

    def unbind(self, suid):
        for uid in self.uids_by_suid[suid]:
            self.tensors[uid] = None


GRAD_NUMELS = [7, 12, 1]  # padded differently for 2 and 4 ranks


def _reduce_rank_main(rank: int, world: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))
    try:
        param = make_params()[0]
        grads, views = [], {}
        for k, n in enumerate(GRAD_NUMELS):
            view = TensorArg(300 + k, 400 + k, 0, n, 4, "cpu", (n,), (1,), "float32")
            view.uid, view.suid = 10 + k, 10 + k
            views[view.suid] = [view]
            grads.append(ModelState(view.suid, GRAD, param, n, "float32", 4, 0, 1, False, 0))
        store, memory = RegistryStore({s: [s] for s in views}), FakeMemory()
        bucket = Bucket(0, grads, 1)
        rt = ModelStatesRuntime(StatesPlan(grads, [bucket]), world, rank, torch.device("cpu"),
                                store, memory, Zero3Metrics(), views, dist.group.WORLD)
        rt.run([("grad_full", g) for g in grads])
        assert memory.held_bytes == 4 * sum(GRAD_NUMELS)
        for g in grads:  # what backward made on this rank
            store.tensors[g.suid] = torch.arange(g.numel, dtype=torch.float32) + 1000.0 * rank
        rt.run([("reduce_scatter", bucket)])
        mean_rank = sum(range(world)) / world
        for g in grads:
            s = shard_numel(g.numel, world)
            padded = torch.zeros(s * world)
            padded[:g.numel] = torch.arange(g.numel, dtype=torch.float32) + 1000.0 * mean_rank
            expected = padded[rank * s:(rank + 1) * s]  # averaged; the padding stays zero
            assert torch.equal(store.tensors[g.suid], expected), (world, rank, g.numel)
        assert memory.held_bytes == 4 * sum(shard_numel(n, world) for n in GRAD_NUMELS)
        assert rt.metrics.grad_full_bytes == 0 and rt.metrics.num_reduce_scatters == 1
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # 2 and 4 spawned gloo ranks
@pytest.mark.parametrize("world", [2, 4])
def test_reduce_scatter_leaves_each_rank_its_averaged_gradient_shards(world):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_reduce_rank_main, args=(world, free_port()), nprocs=world, join=True)
