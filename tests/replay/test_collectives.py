"""Collective replay (actors.replay.comm.replayer), process groups and bandwidth math.

Multi-rank tests use gloo through torch.multiprocessing spawn (no Ray): every rank replays a
hand-built list of collective Ops in full mode (dict-backed registry, results checked) and in
comms mode (arena buffers, stats checked). Assertions run inside the ranks; spawn re-raises.
"""
import json
import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from actors.errors import ConfigError, ReplayError
from actors.replay.comm.async_plan import plan_async
from actors.trace.op_schema import is_view_op
from actors.replay.comm.replayer import CollectiveReplayer
from actors.replay.comm.bandwidth import CommStats, bus_bandwidth, bus_factor, message_bytes
from actors.replay.comm.process_groups import ProcessGroups, merge_group_tables, resolve_pg_name
from actors.trace.model import Arg, Collective, Op, ProcessGroupInfo, TensorArg
from tests.support.bounds import LOAD_MARGIN_S

ITEMSIZE = {"float32": 4, "int64": 8}


# --- building ops by hand ----------------------------------------------------------------
class Builder:
    """Makes TensorArgs with fresh uids and Ops with consecutive indices."""

    def __init__(self):
        self.ops, self.uid = [], 0

    def t(self, *shape, dtype="float32"):
        numel = 1
        for s in shape:
            numel *= s
        arg = TensorArg(self.uid + 1, self.uid + 1, 0, numel, ITEMSIZE[dtype], "cpu", tuple(shape),
                        None, dtype)
        arg.uid = arg.suid = self.uid
        self.uid += 1
        return arg

    def op(self, name, kind, inputs, outputs=(), **kw):
        tensors = [x for a in inputs for x in ([a] if type(a) is TensorArg else
                                              (a.value if a.kind == "tensor_list" else ()))]
        kw.setdefault("dtype", tensors[0].dtype if tensors else None)
        op = Op(len(self.ops), 1000 + len(self.ops), name, "", tuple(inputs), tuple(outputs), None,
                "", -1, Collective(kind, **kw), 1)
        self.ops.append(op)
        return op


def L(*tensors):
    return Arg("tensor_list", tuple(tensors))


OBJ = Arg("object", "<Object>")


def build_ops(n, r):
    """(ops, fills {uid: tensor}, checks [(uid, expected tensor)], expected {kind: [calls, bytes]})."""
    b, fills, checks, exp = Builder(), {}, [], {}

    def count(kind, nbytes):
        e = exp.setdefault(kind, [0, 0])
        e[0] += 1
        e[1] += nbytes

    x = b.t(5)  # c10d all_reduce in place
    fills[x.uid] = torch.ones(5)
    b.op("c10d::allreduce_", "all_reduce", [L(x), OBJ], [L(x)], in_nelems=5, out_nelems=5)
    checks.append((x.uid, torch.full((5,), float(n))))
    count("all_reduce", 20)
    a, y = b.t(4), b.t(4)  # functional: output is a new tensor, input untouched
    fills[a.uid] = torch.full((4,), 2.0)
    b.op("_c10d_functional::all_reduce", "all_reduce", [a, Arg("str", "sum"), Arg("str", "0")],
         [y], in_nelems=4, out_nelems=4, pg_name="0", source="functional")
    checks += [(y.uid, torch.full((4,), 2.0 * n)), (a.uid, torch.full((4,), 2.0))]
    count("all_reduce", 16)
    z = b.t(6)  # async (seq 7), completed at a later wait
    fills[z.uid] = torch.full((6,), float(r))
    b.op("c10d::allreduce_", "all_reduce", [L(z), OBJ], [L(z)], in_nelems=6, out_nelems=6,
         seq=7, pg_name="0", source="record_param_comms")
    checks.append((z.uid, torch.full((6,), float(sum(range(n))))))
    count("all_reduce", 24)
    k = b.t(3, dtype="int64")  # integer reductions use MAX (keeps index ranges)
    fills[k.uid] = torch.full((3,), r, dtype=torch.int64)
    b.op("c10d::allreduce_", "all_reduce", [L(k), OBJ], [L(k)], in_nelems=3, out_nelems=3)
    checks.append((k.uid, torch.full((3,), n - 1, dtype=torch.int64)))
    count("all_reduce", 24)
    b.op("record_param_comms", "wait", [Arg("int", 7)], wait_seq=7, dtype=None)
    c1, c2 = b.t(3), b.t(4)
    fills[c1.uid], fills[c2.uid] = torch.ones(3), torch.ones(4)
    b.op("c10d::allreduce_coalesced_", "all_reduce_coalesced", [L(c1, c2), OBJ], [],
         in_nelems=7, out_nelems=7)
    checks += [(c1.uid, torch.full((3,), float(n))), (c2.uid, torch.full((4,), float(n)))]
    count("all_reduce_coalesced", 28)

    g_in, g_outs = b.t(3), [b.t(3) for _ in range(n)]
    fills[g_in.uid] = torch.full((3,), float(r))
    b.op("c10d::allgather_", "all_gather", [L(*g_outs), L(g_in), OBJ], [L(*g_outs)],
         in_nelems=3, out_nelems=3 * n)
    checks += [(t.uid, torch.full((3,), float(i))) for i, t in enumerate(g_outs)]
    count("all_gather", 12 * n)
    gi, go = b.t(2), b.t(2 * n)
    fills[gi.uid] = torch.full((2,), float(r))
    b.op("c10d::_allgather_base_", "all_gather_into_tensor", [go, gi, OBJ], [go],
         in_nelems=2, out_nelems=2 * n)
    checks.append((go.uid, torch.arange(n, dtype=torch.float32).repeat_interleave(2)))
    count("all_gather_into_tensor", 8 * n)
    p_in, p_out = [b.t(2), b.t(3)], [b.t(2 * n), b.t(3 * n)]
    fills[p_in[0].uid], fills[p_in[1].uid] = torch.ones(2), torch.full((3,), float(r))
    b.op("c10d::allgather_into_tensor_coalesced_", "all_gather_into_tensor_coalesced",
         [L(*p_out), L(*p_in), OBJ], [L(*p_out)], in_nelems=5, out_nelems=5 * n)
    checks += [(p_out[0].uid, torch.ones(2 * n)),
               (p_out[1].uid, torch.arange(n, dtype=torch.float32).repeat_interleave(3))]
    count("all_gather_into_tensor_coalesced", 20 * n)

    rs_in, rs_out = [b.t(2) for _ in range(n)], b.t(2)
    for i, t in enumerate(rs_in):
        fills[t.uid] = torch.full((2,), float(i))
    b.op("c10d::reduce_scatter_", "reduce_scatter", [L(rs_out), L(*rs_in), OBJ, OBJ], [L(rs_out)],
         in_nelems=2 * n, out_nelems=2)
    checks.append((rs_out.uid, torch.full((2,), float(r * n))))
    count("reduce_scatter", 8 * n)
    ri, ro = b.t(3 * n), b.t(3)
    fills[ri.uid] = torch.ones(3 * n)
    b.op("c10d::_reduce_scatter_base_", "reduce_scatter_tensor", [ro, ri, OBJ, OBJ], [ro],
         in_nelems=3 * n, out_nelems=3)
    checks.append((ro.uid, torch.full((3,), float(n))))
    count("reduce_scatter_tensor", 12 * n)
    q_in, q_out = [b.t(2 * n), b.t(n)], [b.t(2), b.t(1)]
    fills[q_in[0].uid], fills[q_in[1].uid] = torch.ones(2 * n), torch.ones(n)
    b.op("c10d::reduce_scatter_tensor_coalesced_", "reduce_scatter_tensor_coalesced",
         [L(*q_out), L(*q_in), OBJ, OBJ], [L(*q_out)], in_nelems=3 * n, out_nelems=3)
    checks += [(q_out[0].uid, torch.full((2,), float(n))), (q_out[1].uid, torch.full((1,), float(n)))]
    count("reduce_scatter_tensor_coalesced", 12 * n)

    a_in, a_out = [b.t(2) for _ in range(n)], [b.t(2) for _ in range(n)]
    for j, t in enumerate(a_in):
        fills[t.uid] = torch.full((2,), float(10 * r + j))
    b.op("c10d::alltoall_", "all_to_all", [L(*a_out), L(*a_in), OBJ], [L(*a_out)],
         in_nelems=2 * n, out_nelems=2 * n)
    checks += [(t.uid, torch.full((2,), float(10 * i + r))) for i, t in enumerate(a_out)]
    count("all_to_all", 8 * n)
    u_in = [b.t(j + 1 + r) for j in range(n)]  # unequal list entries: the packed path
    u_out = [b.t(i + 1 + r) for i in range(n)]
    for j, t in enumerate(u_in):
        fills[t.uid] = torch.full((j + 1 + r,), float(10 * r + j))
    u_nel = sum(j + 1 + r for j in range(n))
    b.op("c10d::alltoall_", "all_to_all", [L(*u_out), L(*u_in), OBJ], [L(*u_out)],
         in_nelems=u_nel, out_nelems=u_nel,
         in_splits=[j + 1 + r for j in range(n)], out_splits=[i + 1 + r for i in range(n)])
    checks += [(t.uid, torch.full((i + 1 + r,), float(10 * i + r))) for i, t in enumerate(u_out)]
    count("all_to_all", 4 * u_nel)
    in_splits = [r + j + 1 for j in range(n)]  # uneven all_to_all_single, async + wait
    out_splits = [i + r + 1 for i in range(n)]
    si, so = b.t(sum(in_splits)), b.t(sum(out_splits))
    fills[si.uid] = torch.cat([torch.full((s,), float(100 * r + j)) for j, s in enumerate(in_splits)])
    b.op("c10d::alltoall_base_", "all_to_all_single", [so, si, OBJ, Arg("int_list", out_splits),
         Arg("int_list", in_splits)], [], in_nelems=sum(in_splits), out_nelems=sum(out_splits),
         in_splits=in_splits, out_splits=out_splits, seq=8)
    checks.append((so.uid, torch.cat([torch.full((s,), float(100 * i + r))
                                      for i, s in enumerate(out_splits)])))
    count("all_to_all_single", 4 * sum(in_splits))
    row_in, row_out = b.t(2 * n, 3), b.t(2 * n, 3)  # splits counted in dim-0 rows
    fills[row_in.uid] = torch.full((2 * n, 3), float(r))
    b.op("c10d::alltoall_base_", "all_to_all_single", [row_out, row_in, OBJ], [],
         in_nelems=6 * n, out_nelems=6 * n, in_splits=[2] * n, out_splits=[2] * n)
    checks.append((row_out.uid, torch.arange(n, dtype=torch.float32).repeat_interleave(2)
                   .unsqueeze(1).expand(2 * n, 3)))
    count("all_to_all_single", 24 * n)
    b.op("record_param_comms", "wait", [Arg("int", 8)], wait_seq=8, dtype=None)

    bc = b.t(4)
    fills[bc.uid] = torch.full((4,), float(r))
    b.op("c10d::broadcast_", "broadcast", [L(bc), OBJ, Arg("int", 1)], [L(bc)], in_nelems=4,
         out_nelems=4, root=1)
    checks.append((bc.uid, torch.ones(4)))
    count("broadcast", 16)
    rd = b.t(2)
    fills[rd.uid] = torch.full((2,), float(r))
    b.op("c10d::reduce_", "reduce", [L(rd), OBJ, OBJ, Arg("int", 0)], [], in_nelems=2,
         out_nelems=2, root=0)
    if r == 0:
        checks.append((rd.uid, torch.full((2,), float(sum(range(n))))))
    count("reduce", 8)
    gth_in, gth_out = b.t(3), ([b.t(3) for _ in range(n)] if r == 1 else [])
    fills[gth_in.uid] = torch.full((3,), float(r))
    b.op("c10d::gather_", "gather", [L(*gth_out), L(gth_in), OBJ, Arg("int", 1)], [],
         in_nelems=3, out_nelems=3 * len(gth_out), root=1)
    checks += [(t.uid, torch.full((3,), float(i))) for i, t in enumerate(gth_out)]
    count("gather", 12 * n)
    sc_out, sc_in = b.t(2), ([b.t(2) for _ in range(n)] if r == 0 else [])
    for i, t in enumerate(sc_in):
        fills[t.uid] = torch.full((2,), float(i + 5))
    b.op("c10d::scatter_", "scatter", [L(sc_out), L(*sc_in), OBJ, Arg("int", 0)], [L(sc_out)],
         in_nelems=2 * len(sc_in), out_nelems=2, root=0)
    checks.append((sc_out.uid, torch.full((2,), float(r + 5))))
    count("scatter", 8 * n)
    bar = b.t(1)
    b.op("c10d::barrier", "barrier", [bar, OBJ, Arg("list", [])], [], in_nelems=1, out_nelems=1,
         dtype="float32")
    count("barrier", 0)
    p2p = b.t(3)  # pairs (0,1), (2,3): even ranks send to the odd neighbour
    fills[p2p.uid] = torch.full((3,), float(r + 40))
    if r % 2 == 0:
        b.op("c10d::send", "send", [L(p2p), OBJ, Arg("int", r + 1)], [], in_nelems=3,
             out_nelems=3, root=r + 1)
        count("send", 12)
    else:
        b.op("c10d::recv_", "recv", [L(p2p), OBJ, Arg("int", r - 1)], [L(p2p)], in_nelems=3,
             out_nelems=3, root=r - 1)
        checks.append((p2p.uid, torch.full((3,), float(r - 1 + 40))))
        count("recv", 12)
    sub = b.t(2)  # on this rank's pair group ("1" = ranks 0,1; "2" = ranks 2,3)
    fills[sub.uid] = torch.full((2,), float(r))
    b.op("c10d::allreduce_", "all_reduce", [L(sub), OBJ], [L(sub)], in_nelems=2, out_nelems=2,
         pg_name=str(1 + r // 2), group_size=2)
    checks.append((sub.uid, torch.full((2,), float(4 * (r // 2) + 1))))
    count("all_reduce", 8)
    return b.ops, fills, checks, exp


def pair_groups(n):
    table = [ProcessGroupInfo("0", "default_pg", "gloo", (), n)]
    return table + [ProcessGroupInfo(str(1 + k), "pair", "gloo", (2 * k, 2 * k + 1), 2)
                    for k in range(n // 2)]


def _replay_captured(rank, n, out_dir):
    """Capture a gloo trace of every kind, load it with the real loader, replay it."""
    from collections import Counter

    import torch.distributed._functional_collectives as fc
    from torch.profiler import ExecutionTraceObserver

    from actors.trace import load_trace

    et = ExecutionTraceObserver()
    et.register_callback(f"{out_dir}/rank-{rank}.et.json")
    et.start()
    x = torch.ones(6)
    dist.all_reduce(x)
    dist.all_reduce(x, async_op=True).wait()
    dist.all_gather([torch.empty(6) for _ in range(n)], x)
    dist.all_gather_into_tensor(torch.empty(3 * n), torch.full((3,), 1.0))
    dist.reduce_scatter_tensor(torch.empty(3), torch.ones(3 * n))
    dist.reduce_scatter(torch.empty(3), [torch.ones(3) for _ in range(n)])
    ins, outs = ([3, 1], [3, 2]) if rank == 0 else ([2, 4], [1, 4])
    dist.all_to_all_single(torch.empty(sum(outs)), torch.ones(sum(ins)), outs, ins)
    dist.all_to_all([torch.empty(2) for _ in range(n)], [torch.ones(2) for _ in range(n)])
    dist.broadcast(x, src=1)
    dist.reduce(x, dst=1)
    dist.gather(x, [torch.empty(6) for _ in range(n)] if rank == 0 else None, dst=0)
    dist.scatter(x, [torch.ones(6) for _ in range(n)] if rank == 0 else None, src=0)
    dist.barrier()
    if rank == 0:
        dist.send(x, 1)
    else:
        dist.recv(x, 0)
    with dist._coalescing_manager(async_ops=True) as cm:
        dist.all_reduce(torch.ones(4))
        dist.all_reduce(torch.ones(5))
    cm.wait()
    fc.all_reduce(torch.ones(4), "sum", dist.group.WORLD).wait()
    et.stop()
    et.unregister_callback()
    dist.barrier()
    traces = [load_trace(f"{out_dir}/rank-{r}.et.json") for r in range(n)]
    table = merge_group_tables([t.process_groups for t in traces], n)
    groups = ProcessGroups.create(table, rank, n, "gloo", timeout_s=30)
    ops = traces[rank].collectives
    want = Counter(op.collective.kind for op in ops if op.collective.kind != "wait")
    assert len(want) == 14, want
    store = {}

    def get(t):  # every tensor starts as rank + 1
        if t.uid not in store:
            store[t.uid] = torch.full(t.shape, rank + 1, dtype=getattr(torch, t.dtype))
        return store[t.uid]

    for get_tensor in (get, None):
        comm = CollectiveReplayer(groups, torch.device("cpu"), ops=traces[rank].ops)
        for op in ops:
            comm.run(op, get_tensor)
        comm.wait_all()
        assert {k: v["num_calls"] for k, v in comm.stats_dict().items()} == dict(want)
    gathered = next(op for op in ops if op.name == "c10d::_allgather_base_").inputs[0]
    expect = torch.arange(1, n + 1, dtype=torch.float32).repeat_interleave(3)
    torch.testing.assert_close(store[gathered.uid], expect)
    # a peer that never joins: the group's timeout bounds the call
    table = table + [ProcessGroupInfo("9", "short", "gloo", (), n)]
    short = ProcessGroups.create(table, rank, n, "gloo", timeout_s=2)
    if rank == 0:
        b = Builder()
        x = b.t(4)
        op = b.op("c10d::allreduce_", "all_reduce", [L(x), OBJ], [L(x)], in_nelems=4,
                  out_nelems=4, pg_name="9")
        t0 = time.perf_counter()
        with pytest.raises(RuntimeError, match="[Tt]imed out"):
            CollectiveReplayer(short, torch.device("cpu")).run(op, None)
        assert time.perf_counter() - t0 < 2 + LOAD_MARGIN_S  # the group's timeout_s=2
    dist.barrier()


def _worker(rank, n, init_file, out_dir, captured):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=n,
                            timeout=timedelta(seconds=30))
    try:
        if captured:  # shares the spawn: starting ranks costs more than the test itself
            _replay_captured(rank, n, out_dir)
        groups = ProcessGroups.create(pair_groups(n), rank, n, "gloo", timeout_s=30)
        ops, fills, checks, exp = build_ops(n, rank)
        # full mode: the registry is a dict keyed by uid, filled lazily
        store = {}

        def get(t):
            if t.uid not in store:
                store[t.uid] = fills.get(t.uid, torch.zeros(t.shape, dtype=getattr(torch, t.dtype))).clone()
            return store[t.uid]

        comm = CollectiveReplayer(groups, torch.device("cpu"), ops=ops)
        for op in ops:
            comm.run(op, get)
            if op.collective.seq == 7:  # async: issued, waiting for its recorded wait
                assert comm.num_pending == 1
        assert comm.num_pending == 0
        for uid, want in checks:
            torch.testing.assert_close(store[uid], want.to(store[uid].dtype), msg=f"uid {uid}")
        full_stats = comm.stats.to_dict()
        # comms mode twice: buffers come from two arenas that stop growing after pass one
        comms = CollectiveReplayer(groups, torch.device("cpu"), ops=ops)
        for op in ops:
            comms.run(op, None)
        arenas = {k: v.data_ptr() for k, v in comms._arenas.items()}
        comms.stats.reset()
        for op in ops:
            comms.run(op, None)
        comms.wait_all()
        assert {k: v.data_ptr() for k, v in comms._arenas.items()} == arenas
        with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
            json.dump({"full": full_stats, "comms": comms.stats.to_dict(), "exp": exp}, f)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world,captured", [(2, True), (4, False)])
def test_replay_every_kind_full_and_comms(tmp_path, world, captured):
    """Hand-built ops of every kind; with ``captured``, also a real gloo trace via the loader."""
    mp.spawn(_worker, args=(world, str(tmp_path / "init"), str(tmp_path), captured), nprocs=world,
             join=True)
    for rank in range(world):
        got = json.loads((tmp_path / f"{rank}.json").read_text())
        for mode in ("full", "comms"):
            stats = got[mode]
            assert {k: [v["num_calls"], v["bytes"]] for k, v in stats.items()} == got["exp"], mode
            assert all(v["time_s"] > 0 for v in stats.values())


# --- in-process: planning and errors (no process group needed) ---------------------------
def fake_groups(world=2, rank=0):
    members = {"0": tuple(range(world)), "1": (1,)}
    return ProcessGroups(rank, world, {"0": object()}, members)


def test_plan_pairs_waits_with_latest_call_of_that_seq():
    b = Builder()
    x = b.t(2)
    b.op("c10d::allreduce_", "all_reduce", [L(x)], seq=3)  # no wait recorded: synchronous
    b.op("c10d::allreduce_", "all_reduce", [L(x)], seq=5)
    b.op("c10d::allreduce_", "all_reduce", [L(x)], seq=5)
    b.op("record_param_comms", "wait", [], wait_seq=5)
    b.op("record_param_comms", "wait", [], wait_seq=99)  # its call predates the trace
    comm = CollectiveReplayer(fake_groups(), torch.device("cpu"), ops=b.ops)
    assert comm._async == {2} and comm._waited == {3: 2}
    comm.run(b.ops[4], None)  # a wait with nothing outstanding is a no-op
    assert comm.stats.num_calls == 0


@pytest.mark.parametrize("kind,kw,msg", [
    ("all_gather_into_tensor", dict(in_nelems=4, out_nelems=12), "does not fit a 2-rank group"),
    ("reduce_scatter_tensor", dict(in_nelems=6, out_nelems=2), "does not fit a 2-rank group"),
    ("all_reduce", dict(in_nelems=4, out_nelems=4, group_size=4), "recorded group size 4"),
    ("all_to_all_single", dict(in_nelems=6, out_nelems=6, in_splits=[1, 2, 3], out_splits=[2, 2, 2]),
     "one entry per rank"),
    ("all_to_all_single", dict(in_nelems=5, out_nelems=5), "do not split evenly"),
    ("all_reduce", dict(in_nelems=4, out_nelems=4, pg_name="7"), "unknown process group '7'"),
    ("all_reduce", dict(in_nelems=4, out_nelems=4, pg_name="1"), "not a member of process group '1'"),
])
def test_sizes_that_contradict_the_group_raise(kind, kw, msg):
    b = Builder()
    x = b.t(4)
    op = b.op("c10d::x", kind, [x], **kw)
    with pytest.raises(ReplayError, match=msg) as err:
        CollectiveReplayer(fake_groups(), torch.device("cpu")).run(op, None)
    assert f"node {op.node_id}" in str(err.value)


def test_full_mode_buffer_structure_must_match_the_group():
    b = Builder()
    gi, go = b.t(3), b.t(3)
    op = b.op("c10d::allgather_", "all_gather", [L(go), L(gi), OBJ], [L(go)], in_nelems=3,
              out_nelems=6)  # a 2-rank all-gather recorded with one output tensor
    with pytest.raises(ReplayError, match="expected 1 input and 2 output buffer"):
        CollectiveReplayer(fake_groups(), torch.device("cpu")).run(op, lambda t: torch.zeros(t.shape))


def test_public_nccl_trace_replays_on_one_rank(tmp_path, public_trace_dir):
    """resnet_et (DDP, NCCL shape): broadcasts are async and end at their recorded waits."""
    from actors.trace import load_trace
    trace = load_trace(public_trace_dir / "resnet_et.json.gz")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        groups = ProcessGroups.create(trace.process_groups, 0, 1, "gloo", timeout_s=30)
        comm = CollectiveReplayer(groups, torch.device("cpu"), ops=trace.ops)
        assert sorted(trace.ops[i].collective.kind for i in comm._async) == ["broadcast"] * 6
        pending = []
        for op in trace.collectives:
            comm.run(op, None)
            pending.append(comm.num_pending)
        assert pending[:4] == [1, 2, 1, 0]  # two broadcasts in flight, then their two waits
        assert comm.num_pending == 0
        stats = comm.stats_dict()
        assert {k: v["num_calls"] for k, v in stats.items()} == {"all_reduce": 15, "broadcast": 6}
        assert stats["all_reduce"]["bytes"] == 4 * 3 * (2049000 + 7875584 + 6563840 + 6637568 + 2431040)
        assert {k: v.numel() for k, v in comm._arenas.items()} == {"in": 4 * 7875584}
    finally:
        dist.destroy_process_group()


# --- process-group tables ----------------------------------------------------------------
def pg(name, ranks, size, desc="g"):
    return ProcessGroupInfo(name, desc, "gloo", tuple(ranks), size)


def test_merge_group_tables_orders_by_creation_and_keeps_every_group():
    world = pg("0", (), 4, "default_pg")
    tables = [[world, pg("10", (0, 1), 2), pg("2", (0, 2), 2)],
              [world, pg("10", (0, 1), 2), pg("3", (1, 3), 2)],
              [world, pg("2", (0, 2), 2), pg("custom", (2, 3), 2)],
              [world, pg("3", (1, 3), 2), pg("custom", (2, 3), 2)]]
    merged = merge_group_tables(tables, 4)
    assert [g.name for g in merged] == ["0", "2", "3", "10", "custom"]
    assert merged[0].ranks == ()


@pytest.mark.parametrize("tables,msg", [
    ([[pg("1", (0, 1), 2)], [pg("1", (1, 2), 2)], [], []], "differs between rank 0 .* and rank 1"),
    ([[pg("1", (1, 2), 2)], [], [], []], "rank 0 lists process group '1' whose ranks"),
    ([[pg("0", (), 2)], [], [], []], "group_size 2, world size is 4"),
    ([[pg("1", (0, 9), 2)], [], [], []], "world size 4"),
])
def test_merge_group_tables_rejects_inconsistent_tables(tables, msg):
    with pytest.raises(ConfigError, match=msg):
        merge_group_tables(tables, 4)


def test_resolve_pg_name_uses_group_map_only_without_a_name():
    c = Collective("all_gather_into_tensor")
    assert resolve_pg_name(c, None) == "0"
    assert resolve_pg_name(c, {"*": "2"}) == "2"
    assert resolve_pg_name(c, {"*": "2", "all_gather_into_tensor": "1"}) == "1"
    assert resolve_pg_name(Collective("all_reduce", pg_name="5"), {"*": "2"}) == "5"


# --- bandwidth math ----------------------------------------------------------------------
def test_message_bytes_follow_nccl_tests():
    assert message_bytes("all_reduce", 100, 100, 4, 8) == 400
    assert message_bytes("all_gather_into_tensor", 100, 800, 4, 8) == 3200
    assert message_bytes("reduce_scatter_tensor", 800, 100, 2, 8) == 1600
    assert message_bytes("all_to_all_single", 96, 120, 4, 8) == 384
    assert message_bytes("gather", 10, 0, 4, 4) == 160
    assert message_bytes("scatter", 0, 10, 4, 4) == 160
    assert message_bytes("barrier", 1, 1, 1, 4) == 0


def test_bus_factors_and_stats():
    assert bus_factor("all_reduce", 4) == pytest.approx(1.5)
    assert bus_factor("all_gather_into_tensor_coalesced", 4) == pytest.approx(0.75)
    assert bus_factor("all_to_all", 8) == pytest.approx(7 / 8)
    assert bus_factor("broadcast", 8) == 1.0 and bus_factor("send", 2) == 1.0
    assert bus_bandwidth("all_reduce", 1e9, 0.5, 2) == pytest.approx(2e9)
    stats = CommStats()
    stats.add("all_reduce", 1_000_000_000, 0.5, 2)  # factor 1
    stats.add("all_reduce", 1_000_000_000, 0.5, 4)  # factor 1.5
    stats.add("barrier", 0, 0.1, 4)
    other = CommStats()
    other.add("broadcast", 500, 0.0, 2)
    stats.merge(other)
    d = stats.to_dict()
    assert d["all_reduce"] == {"num_calls": 2, "bytes": 2_000_000_000, "time_s": 1.0,
                               "algbw_gbps": pytest.approx(2.0),
                               "busbw_gbps": pytest.approx(2.5)}
    assert d["barrier"]["algbw_gbps"] == 0.0 and d["broadcast"]["busbw_gbps"] == 0.0
    assert stats.num_calls == 4


def test_async_call_without_a_wait_completes_before_its_buffers_first_use():
    """gloo traces record a c10d call's async_op but not the Python work.wait(): the replay
    issues it async and completes it right before the first later op that reads or writes
    its buffers (a view of the buffer, as DeepSpeed makes right away, reads nothing)."""
    b = Builder()
    shard, full, other = b.t(4), b.t(8), b.t(3)
    b.op("c10d::_allgather_base_", "all_gather_into_tensor", [full, shard, OBJ], [full],
         in_nelems=4, out_nelems=8, async_op=True)                              # 0: issued async
    narrow = "aten::narrow(Tensor(a) self, int dim, SymInt start, SymInt length) -> Tensor(a)"
    view = Op(1, 2001, "aten::narrow", narrow, (full,), (full,), None, "", -1, None, 1)  # no data
    reader = Op(2, 2002, "aten::relu", "aten::relu(Tensor self) -> Tensor", (full,), (b.t(8),),
                None, "", -1, None, 1)                                                # reads it
    b.ops += [view, reader]
    b.op("c10d::allreduce_", "all_reduce", [L(other), OBJ], [L(other)], in_nelems=3,
         out_nelems=3, async_op=False)                                          # 3: sync
    assert is_view_op(narrow) and not is_view_op(reader.schema)
    plan = plan_async(b.ops)
    assert plan.calls == {0} and plan.waited == {}
    assert plan.complete_before == {2: [0]}
