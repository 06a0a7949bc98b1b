"""The trace loader (actors.trace): every public GPU trace, real gloo captures, hand-written traces."""
from __future__ import annotations

import gzip
import json
import os
from collections import Counter
from functools import lru_cache

import pytest

from actors.errors import TraceError
from actors.trace import TensorArg, compute_liveness, load_trace, read_json
from actors.trace.collectives import C10D_KINDS, FUNCTIONAL, FUNCTIONAL_CALLS
from actors.trace.parent_links import file_order, mend_parent_links
from actors.trace.source import discover
from orchestrator.config import REPO_ROOT
from tests.support.et_json import (ADD, ADD_, CLONE, EMBEDDING, EMPTY, FLATTEN, ONES, RELU, VIEW,
                                   broadcast_node, node, scalar, step_node, tensor, tensor_list,
                                   write_trace)

REPO = REPO_ROOT
DEMO_DP = REPO / "demo" / "traces" / "gpt_dp_4"
DLRM_ARCHIVE = "dlrm_pytorch_et.tar.gz"
RESNET_KINDS = {"all_reduce": 15, "broadcast": 6, "wait": 6}
# Per public file (see shared/traces/public/README.md): schema, nodes, process-group table as
# (name, desc, backend, size), collective kinds, number of ProfilerStep windows, devices of its
# tensors (ResNet's CPU ones were all Python numbers: host scalars, counted in HOST_SCALARS).
PUBLIC_FILES = {
    "resnet_et.json.gz": ("1.1.0-chakra.0.0.4", 14392, [("0", "default_pg", "cuda:nccl", 1)],
                          RESNET_KINDS, 3, {"cuda:0"}),
    "resnet_1gpu_et.json.gz": ("1.0.3-chakra.0.0.4", 14391, [], RESNET_KINDS, 3, {"cuda:0"}),
    "resnet_2gpu_et.json.gz": ("1.1.0-chakra.0.0.4", 14392, [("0", "default_pg", "cuda:nccl", 2)],
                               RESNET_KINDS, 3, {"cuda:1"}),
    "resnet_1gpu_et.json.tar.gz": ("1.1.1-chakra.0.0.4", 14392, [("0", "default_pg", "cuda:nccl", 1)],
                                   RESNET_KINDS, 3, {"cuda:0"}),
    # ProfilerStep#0 and #1 are in the file, but #1 was cut off before any op ran
    "hf_GPT2_et.json.tar.gz": ("1.1.0-chakra.0.0.4", 27156, [], {}, 1, {"cuda:0", "cpu"}),
    "linear_et.json.gz": ("1.0.1", 931, [], {}, 0, {"cuda:0"}),
}
# Python numbers the ops were called with (actors/trace/host_scalars.py), per file
HOST_SCALARS = {"hf_GPT2_et.json.tar.gz": 252, "linear_et.json.gz": 0}


@lru_cache(maxsize=None)
def _load_cached(path: str):
    return load_trace(path)


def kinds(trace) -> Counter:
    return Counter(op.collective.kind for op in trace.collectives)


def devices(trace) -> set:
    return {t.device for op in trace.ops for t in op.input_tensors() + op.output_tensors()}


# ---------------------------------------------------------------- public GPU traces

def test_every_public_file_is_described(public_trace_dir):
    assert {p.name for p in public_trace_dir.iterdir()} == set(PUBLIC_FILES) | {DLRM_ARCHIVE}


@pytest.mark.parametrize("name", sorted(PUBLIC_FILES))
def test_public_trace(public_trace_dir, name):
    schema, num_nodes, pgs, want_kinds, num_steps, want_devices = PUBLIC_FILES[name]
    trace = _load_cached(str(public_trace_dir / name))
    assert (trace.schema, trace.num_nodes) == (schema, num_nodes)
    assert [(g.name, g.desc, g.backend, g.group_size) for g in trace.process_groups] == pgs
    assert kinds(trace) == want_kinds
    assert len(trace.steps) == num_steps and devices(trace) == want_devices
    assert trace.meta["num_host_scalars"] == HOST_SCALARS.get(name, 642)
    assert [op.index for op in trace.ops] == list(range(len(trace.ops))) and len(trace.ops) > 100
    ids = [op.node_id for op in trace.ops]
    assert ids == sorted(ids)  # execution order
    if num_steps:
        assert trace.steps[0].first == 0 and trace.steps[-1].end == len(trace.ops)


@pytest.mark.parametrize("name", [n for n in sorted(PUBLIC_FILES) if n.startswith("resnet")])
def test_resnet_iterations_and_async_calls(public_trace_dir, name):
    trace = _load_cached(str(public_trace_dir / name))
    for i, step in enumerate(trace.steps):  # 2 broadcasts and 5 all-reduces per iteration
        assert step.name.startswith("ProfilerStep#")
        per_step = Counter(op.collective.kind for op in trace.ops[step.first:step.end] if op.collective)
        assert per_step == {"all_reduce": 5, "broadcast": 2, "wait": 2}
        assert all(op.step == i for op in trace.ops[step.first:step.end])
    seqs = set()
    for op in trace.collectives:
        c = op.collective
        if c.kind == "wait":
            assert c.wait_seq in seqs and c.async_op is None  # completes an earlier call
            continue
        assert op.name in ("c10d::allreduce_", "c10d::broadcast_")
        assert (c.pg_name, c.pg_desc, c.source) == ("0", "default_pg", "record_param_comms")
        assert c.dtype in ("float32", "int64") and c.in_nelems == c.out_nelems > 0
        assert c.root == (0 if c.kind == "broadcast" else None)
        # broadcasts record asyncOp=True (and are waited for); these all_reduce schemas
        # record no flag and nothing waits for them
        assert c.async_op is (c.kind == "broadcast")
        seqs.add(c.seq)


def test_resnet_group_attrs_by_schema(public_trace_dir):
    """1.1.x records group size and rank layout as attrs; 1.0.3 only names the group."""
    new = _load_cached(str(public_trace_dir / "resnet_2gpu_et.json.gz")).collectives[0].collective
    old = _load_cached(str(public_trace_dir / "resnet_1gpu_et.json.gz")).collectives[0].collective
    assert (new.group_size, new.rank_start, new.rank_stride) == (2, 0, 1)
    assert (old.pg_name, old.group_size, old.rank_start) == ("0", None, None)


def test_gzip_and_plain_load_alike(public_trace_dir, tmp_path):
    gz = public_trace_dir / "resnet_et.json.gz"
    plain = tmp_path / "resnet_et.json"
    plain.write_bytes(gzip.decompress(gz.read_bytes()))
    a, b = _load_cached(str(gz)), load_trace(plain)
    assert (a.num_nodes, a.num_tensors, a.num_storages) == (b.num_nodes, b.num_tensors, b.num_storages)
    assert [(op.node_id, op.name, op.step) for op in a.ops] == [(op.node_id, op.name, op.step) for op in b.ops]
    assert [op.collective.signature() for op in a.collectives] == \
           [op.collective.signature() for op in b.collectives]


def test_dlrm_eight_ranks(dlrm_rank_dir):
    for r in range(8):
        trace = load_trace(dlrm_rank_dir / f"rank-{r}.json")
        assert (trace.rank, trace.schema, trace.num_nodes, trace.steps) == (r, "1.0.1", 1675, [])
        # all_to_allv x4 and all_to_all x1 both normalize to all_to_all_single
        assert kinds(trace) == {"all_to_all_single": 5, "all_reduce": 3, "wait": 5}
        assert trace.process_groups == []  # 1.0.1: the group is only a raw integer handle
        assert devices(trace) <= {f"cuda:{r}", "cpu"}


def test_multi_rank_archive_members(public_trace_dir, dlrm_rank_dir):
    """Each rank reads its own member of the DLRM archive, by name or from its shipped bytes."""
    archive = public_trace_dir / DLRM_ARCHIVE
    sources = discover(archive)
    assert sorted(sources) == list(range(8))
    source = sources[3]
    assert source.member == "dlrm_pytorch_et/dlrm_eg_3.json" and os.fspath(source) == str(archive)
    extracted = load_trace(dlrm_rank_dir / "rank-3.json")
    for trace in (load_trace(source), load_trace(source, data=source.read_raw())):
        assert trace.rank == 3 and trace.path == f"{archive}:dlrm_pytorch_et/dlrm_eg_3.json"
        assert [(op.node_id, op.name) for op in trace.ops] == \
               [(op.node_id, op.name) for op in extracted.ops]
    # the archive as one trace file is refused, naming the way to read every rank
    with pytest.raises(TraceError, match="holds 8 trace files .* pass the archive as trace.dir") as err:
        load_trace(archive)
    assert err.value.path == str(archive)


# ---------------------------------------------------------------- real gloo captures

def test_demo_gloo_ranks():
    """The captured 4-rank DDP GPT: one all_reduce per gradient bucket, covering every parameter."""
    meta = json.loads((DEMO_DP / "meta.json").read_text())
    traces = [load_trace(DEMO_DP / f"rank-{r}.et.json.gz") for r in range(meta["world_size"])]
    for r, trace in enumerate(traces):
        assert trace.schema.startswith("1.1.1") and trace.rank == r
        assert [(g.name, g.group_size) for g in trace.process_groups] == [("0", meta["world_size"])]
        assert [s.name for s in trace.steps] == ["ProfilerStep#8"]
        assert {op.name for op in trace.collectives} == {"c10d::allreduce_"}
        calls = [op.collective for op in trace.collectives]
        assert sum(c.in_nelems for c in calls) == meta["num_params"]
        assert all((c.dtype, c.source, c.async_op) == ("float32", "c10d", False) for c in calls)
    assert len({tuple(op.collective.signature() for op in t.collectives) for t in traces}) == 1


def test_capture_ranks(tmp_path):
    """trace_factory's real 2-rank gloo DP step: gradients all-reduced parameter by parameter."""
    from tests.support.trace_factory import IndexHeavy, capture_ranks

    world = 2
    capture_ranks(tmp_path, world)
    param_numels = sorted(p.numel() for p in IndexHeavy().parameters())
    for r in range(world):
        trace = load_trace(tmp_path / f"rank-{r}.et.json")
        assert trace.rank == r and [s.name for s in trace.steps] == ["ProfilerStep#1"]
        assert [(g.name, g.group_size) for g in trace.process_groups] == [("0", world)]
        calls = [op.collective for op in trace.collectives]
        assert sorted(c.in_nelems for c in calls if c.kind == "all_reduce") == param_numels
        gather = next(c for c in calls if c.kind == "all_gather_into_tensor")
        assert (gather.in_nelems, gather.out_nelems) == (8, 8 * world)
        bcast = next(c for c in calls if c.kind == "broadcast")
        assert (bcast.root, bcast.in_nelems, bcast.out_nelems) == (0, 8 * world, 8 * world)


def test_top_level_selection(gloo_trace_dir):
    """Ops are the outermost nodes with an op schema; their nested children are not ops.

    Parent links are read as the loader mends them (test_parent_links covers the mend): gloo's
    thread records the functional reduce-scatter's own ``chunk``/``copy_`` under the
    ``gloo:all_reduce`` range, under the functional op or under its ``wait_tensor`` from one run
    to the next, and they are the collective's work in each, never ops of their own."""
    path = gloo_trace_dir / "rank-0.json"
    trace = load_trace(path)
    raw = read_json(path)["nodes"]
    position = file_order(raw)
    nodes = {n["id"]: n for n in sorted(raw, key=lambda n: n["id"])}
    if position is not None:
        mend_parent_links(list(nodes.values()), False, position)
    has_schema = {nid for nid, n in nodes.items()
                  if any(a["name"] == "op_schema" and a["value"] for a in n["attrs"])}

    def op_ancestor(nid):
        parent = nodes[nid]["ctrl_deps"]
        while parent in nodes and parent != nid:
            if parent in has_schema:
                return parent
            nid, parent = parent, nodes[parent]["ctrl_deps"]
        return None

    op_ids = {op.node_id for op in trace.ops}
    # collectives are calls of their own wherever the observer nests them, except the c10d
    # op an eager functional collective calls to do its work
    def implements_functional(nid):
        parent = op_ancestor(nid)
        return nodes[nid]["name"] not in FUNCTIONAL and parent is not None \
            and nodes[parent]["name"] in FUNCTIONAL_CALLS

    promoted = {nid for nid in has_schema if nodes[nid]["name"] in C10D_KINDS
                and op_ancestor(nid) is not None and not implements_functional(nid)}
    assert any(implements_functional(nid) for nid in has_schema)  # c10d ops inside functional ones
    assert op_ids == {nid for nid in has_schema if op_ancestor(nid) is None} | promoted
    ones = next(op for op in trace.ops if op.name == "aten::ones")
    children = {nid for nid in nodes if nodes[nid]["ctrl_deps"] == ones.node_id}
    assert "aten::empty" in {nodes[nid]["name"] for nid in children} and not children & op_ids
    assert not any(op.name.startswith("gloo:") for op in trace.ops)


def test_tensor_range_from_capture(gloo_trace_dir):
    trace = load_trace(gloo_trace_dir / "rank-0.json")
    emb = next(op for op in trace.ops if op.name == "aten::embedding")
    lo, hi = emb.tensor_ranges[1]  # the indices, drawn from randint(0, 50)
    assert 0 <= lo <= hi < 50


# ---------------------------------------------------------------- hand-written traces

def _relu(nid, parent=2, k=0):
    return node(nid, "aten::relu", parent=parent, inputs=[tensor(k, k, 4)], outputs=[tensor(k + 1, k + 1, 4)],
                schema=RELU)


def test_profiler_step_windows(tmp_path):
    """Set-up ops and ops between steps are dropped; another thread's op inside a step's id span
    (autograd, comm hooks) belongs to that step."""
    path = write_trace(tmp_path, [
        _relu(3, k=100),                        # before any step: set-up
        step_node(4, 0), _relu(5, 4, k=10),
        node(6, "## forward ##", parent=4), _relu(7, 6, k=20),
        node(8, "[pytorch|profiler|execution_trace|thread]", parent=1), _relu(9, 8, k=30),
        _relu(10, 4, k=40),
        _relu(11, k=50),                        # between the steps
        step_node(12, 1), _relu(13, 12, k=60),
        _relu(14, k=70),                        # after the last step
    ])
    trace = load_trace(path)
    assert [(op.node_id, op.step) for op in trace.ops] == [(5, 0), (7, 0), (9, 0), (10, 0), (13, 1)]
    assert [(s.name, s.first, s.end) for s in trace.steps] == [("ProfilerStep#0", 0, 4),
                                                                ("ProfilerStep#1", 4, 5)]
    assert trace.meta["num_dropped_ops"] == 3 and trace.ops[1].module == "## forward ##"


def test_no_profiler_step_keeps_every_op(tmp_path):
    trace = load_trace(write_trace(tmp_path, [_relu(3, k=1), _relu(4, k=2)]))
    assert [(op.node_id, op.step) for op in trace.ops] == [(3, -1), (4, -1)] and trace.steps == []


def test_gzip_hand_written(tmp_path):
    plain = write_trace(tmp_path, [step_node(3, 0), _relu(4, 3, k=1)])
    gz = tmp_path / "rank-5.et.json.gz"
    gz.write_bytes(gzip.compress(plain.read_bytes()))
    trace = load_trace(gz)
    assert (trace.rank, [op.name for op in trace.ops], trace.steps[0].name) == (5, ["aten::relu"], "ProfilerStep#0")


def test_tensor_ids(tmp_path):
    path = write_trace(tmp_path, [
        node(3, "aten::empty", outputs=[tensor(10, 100, 16)], inputs=[scalar([16], "GenericList[Int]")],
             schema=EMPTY),
        node(4, "aten::view", inputs=[tensor(10, 100, 16), scalar([4, 4], "GenericList[Int]")],
             outputs=[tensor(11, 100, 16, shape=[4, 4])], schema=VIEW),
        node(5, "aten::add_", inputs=[tensor(11, 100, 16, shape=[4, 4]), tensor(12, 200, 16), scalar(1)],
             outputs=[tensor(11, 100, 16, shape=[4, 4])], schema=ADD_),
        # the allocator hands storage 100 to a fresh tensor: a new generation
        node(6, "aten::ones", inputs=[scalar([16], "GenericList[Int]")], outputs=[tensor(10, 100, 16)],
             schema=ONES),
        # ... then to an int64 tensor recorded only as an input: another generation
        node(7, "aten::clone", inputs=[tensor(13, 100, 8, "long int")], outputs=[tensor(14, 300, 8, "long int")],
             schema=CLONE),
    ])
    ops = load_trace(path).ops
    assert [op.name for op in ops] == ["aten::empty", "aten::view", "aten::add_", "aten::ones", "aten::clone"]
    base, view = ops[1].input_tensors()[0], ops[1].output_tensors()[0]
    assert ops[0].output_tensors()[0].suid == base.suid == view.suid  # views share the base's suid
    assert base.uid != view.uid and base.uid == ops[0].output_tensors()[0].uid
    inplace_in, inplace_out = ops[2].input_tensors()[0], ops[2].output_tensors()[0]
    assert (inplace_in.suid, inplace_in.uid) == (inplace_out.suid, inplace_out.uid) == (view.suid, view.uid)
    fresh = ops[3].output_tensors()[0]
    assert fresh.suid != base.suid and fresh.uid != base.uid  # same raw tuple, new generation
    other_dtype = ops[4].input_tensors()[0]
    assert other_dtype.dtype == "int64" and other_dtype.suid not in (base.suid, fresh.suid)
    assert ops[2].input_tensors()[1].suid not in (base.suid, fresh.suid, other_dtype.suid)


def test_liveness_lower_bound(tmp_path):
    """Storages of 400/200/400/400/100/400 B; live bytes per op: 400, 600, 1000, 800, 900."""
    size = [scalar([100], "GenericList[Int]")]
    path = write_trace(tmp_path, [
        node(3, "aten::empty", inputs=size, outputs=[tensor(1, 1, 100)], schema=EMPTY),
        node(4, "aten::empty", inputs=size, outputs=[tensor(2, 2, 50)], schema=EMPTY),
        # reads x through a view of its second half: x's size stays its full 400 B
        node(5, "aten::add", inputs=[tensor(9, 1, 50, offset=50), tensor(2, 2, 50), scalar(1)],
             outputs=[tensor(3, 3, 100)], schema=ADD),
        node(6, "aten::relu", inputs=[tensor(3, 3, 100)], outputs=[tensor(4, 4, 100)], schema=RELU),
        # p (100 B) is first seen as an input: made outside the trace (a parameter)
        node(7, "aten::add", inputs=[tensor(4, 4, 100), tensor(5, 5, 25), scalar(1)],
             outputs=[tensor(6, 6, 100)], schema=ADD),
    ])
    trace = load_trace(path)
    live = compute_liveness(trace.ops, trace.num_storages)
    assert live.live_bytes == [400, 600, 1000, 800, 900]
    assert live.lower_bound_bytes == 1000
    assert sorted(live.storage_bytes) == [100, 200, 400, 400, 400, 400]
    assert live.external_bytes() == 100 and sum(live.storage_external) == 1
    assert [len(f) for f in live.free_after] == [0, 0, 2, 1, 3]


def test_tensor_range_parsed(tmp_path):
    path = write_trace(tmp_path, [
        node(3, "aten::embedding", inputs=[tensor(1, 1, 80, shape=[10, 8]), tensor(2, 2, 4, "long int"),
                                           scalar(-1)],
             outputs=[tensor(3, 3, 32, shape=[4, 8])], schema=EMBEDDING, tensor_range='{"1": [2, 9]}'),
        node(4, "aten::relu", inputs=[tensor(3, 3, 32)], outputs=[tensor(4, 4, 32)], schema=RELU),
    ])
    emb, relu = load_trace(path).ops
    assert emb.tensor_ranges == {1: (2, 9)} and relu.tensor_ranges is None


# ~10 s of CPU on an idle 2-core machine, ten times that beside other jobs: a hang guard, not
# a speed target (the load's speed at 200,000 nodes and at 700 MB is scripts/bench_load.py's)
@pytest.mark.timeout(1800)
def test_a_fifty_thousand_op_chain(tmp_path):
    """A 50,000-op chain, far deeper than any recursion could follow, loads whole and right."""
    num_ops = 50_000
    nodes = [node(3 + i, "aten::add", inputs=[tensor(2 * i, 2 * i + 1, 64), tensor(7, 8, 64), scalar(1)],
                  outputs=[tensor(2 * i + 2, 2 * i + 3, 64)], schema=ADD) for i in range(num_ops)]
    path = write_trace(tmp_path, nodes)
    del nodes
    trace = load_trace(path)
    assert trace.num_nodes == num_ops + 2 and len(trace.ops) == num_ops
    assert trace.ops[-1].node_id == num_ops + 2 and trace.ops[-1].index == num_ops - 1
    # a chain: each output is the next input; the weight (storage 8) is shared: 3 live at a time
    assert trace.num_storages == num_ops + 2
    assert compute_liveness(trace.ops, trace.num_storages).lower_bound_bytes == 3 * 64 * 4


def test_tensor_arg_extent():
    """A transposed view reaches as far as its strides say, from its offset."""
    t = TensorArg(1, 1, 8, 6, 4, "cpu", (2, 3), (1, 2), "float32")
    assert t.extent_elems == 8 + 1 + 1 * 1 + 2 * 2


# ---------------------------------------------------------------- parent links around collectives

ALLREDUCE = ("c10d::allreduce_(Tensor[] tensors, __torch__.torch.classes.c10d.ProcessGroup "
             "process_group, __torch__.torch.classes.c10d.ReduceOp reduce_op, "
             "Tensor? sparse_indices, bool asyncOp, int timeout=-1) -> "
             "(Tensor[], __torch__.torch.classes.c10d.Work)")
FUNC_ALL_REDUCE = "_c10d_functional::all_reduce(Tensor input, str reduce_op, str group_name) -> Tensor"


def _rpc(nid, parent, t, name="broadcast", dtype="Long"):
    """An NCCL-shaped record_param_comms record (1.1.0+ attrs) of tensor ``t``."""
    return node(nid, "record_param_comms", parent=parent,
                inputs=[tensor_list(tensor(t, t, 8, "long int")), scalar(3), scalar(0),
                        scalar(name, "String")],
                collective_name=name, dtype=dtype, pg_name="0", pg_desc="default_pg")


def _collectives(trace):
    return [(op.node_id, op.collective.kind, op.collective.dtype) for op in trace.collectives]


def test_collective_nested_under_the_previous_one_is_its_own_op(tmp_path):
    """gloo shape, as on the root rank of DDP's two buffer broadcasts: the second broadcast and
    both backend nodes sit under the first broadcast."""
    trace = load_trace(write_trace(tmp_path, [
        node(3, "DistributedDataParallel.forward"),
        broadcast_node(4, 10, parent=3), node(5, "gloo:broadcast", parent=4),
        broadcast_node(6, 11, parent=4, dtype="long int"), node(7, "gloo:broadcast", parent=4),
        _relu(8, parent=3, k=20),
    ]))
    assert _collectives(trace) == [(4, "broadcast", "float32"), (6, "broadcast", "int64")]
    assert [op.module for op in trace.ops] == ["DistributedDataParallel.forward"] * 3


def test_nccl_collective_nested_under_the_previous_one_keeps_its_own_record(tmp_path):
    trace = load_trace(write_trace(tmp_path, [
        broadcast_node(3, 10), _rpc(4, 3, 10, dtype="Float"), node(5, "nccl:broadcast", parent=3),
        broadcast_node(6, 11, parent=3, dtype="long int"), _rpc(7, 6, 11),
    ]))
    calls = [op.collective for op in trace.collectives]
    assert [(op.node_id, c.kind, c.dtype, c.source, c.pg_name) for op, c in zip(trace.collectives, calls)] \
        == [(3, "broadcast", "float32", "record_param_comms", "0"),
            (6, "broadcast", "int64", "record_param_comms", "0")]


def test_collective_under_an_unrelated_op_is_its_own_op(tmp_path):
    """Seen on rank 0 of a real DDP capture: the int64 buffer broadcast recorded under the
    flatten of the next bucket; the op keeps its own children (not ops)."""
    trace = load_trace(write_trace(tmp_path, [
        node(3, "aten::flatten_dense_tensors", schema=FLATTEN,
             inputs=[tensor_list(tensor(20, 20, 8))], outputs=[tensor(21, 21, 8)]),
        _relu(4, parent=3, k=30), broadcast_node(5, 11, parent=3, dtype="long int"),
    ]))
    assert [op.node_id for op in trace.ops] == [3, 5]
    assert _collectives(trace) == [(5, "broadcast", "int64")]


def test_c10d_op_inside_a_functional_collective_is_its_implementation(tmp_path):
    """Eager functional collectives call a c10d op: one call, not two."""
    trace = load_trace(write_trace(tmp_path, [
        node(3, FUNC_ALL_REDUCE.split("(")[0], schema=FUNC_ALL_REDUCE,
             inputs=[tensor(1, 1, 8), scalar("sum", "String"), scalar("0", "String")],
             outputs=[tensor(2, 2, 8)]),
        node(4, "c10d::allreduce_", parent=3, schema=ALLREDUCE,
             inputs=[tensor_list(tensor(2, 2, 8)), scalar("<Object>", "Object"),
                     scalar("<Object>", "Object"), scalar(None, "None"), scalar(False, "Bool"),
                     scalar(-1)], outputs=[tensor_list(tensor(2, 2, 8))]),
        node(5, "gloo:all_reduce", parent=4),
    ]))
    assert [(op.node_id, op.collective.kind, op.collective.source) for op in trace.ops] == \
        [(3, "all_reduce", "functional")]


def test_backend_nodes_are_transparent(tmp_path):
    """A backend node recorded under a later op (a forward parent link) with an op under it:
    that op belongs to the backend node's parent, and the backend node names no module."""
    trace = load_trace(write_trace(tmp_path, [
        node(3, "aten::unflatten_dense_tensors", schema=FLATTEN,
             inputs=[tensor_list(tensor(20, 20, 8))], outputs=[tensor(21, 21, 8)]),
        node(4, "gloo:broadcast", parent=6),
        node(5, "aten::narrow", parent=3, schema=RELU, inputs=[tensor(20, 20, 8)],
             outputs=[tensor(22, 20, 4)]),
        node(6, "aten::slice", parent=5, schema=RELU, inputs=[tensor(20, 20, 8)],
             outputs=[tensor(23, 20, 4)]),
        node(7, "aten::as_strided", parent=4, schema=RELU, inputs=[tensor(20, 20, 8)],
             outputs=[tensor(24, 20, 4)]),
        node(8, "gloo:all_reduce", parent=2), _relu(9, parent=8, k=40),
    ]))
    assert [(op.node_id, op.module) for op in trace.ops] == [(3, ""), (9, "")]


def test_orphans_of_a_range_never_closed_stay_in_their_step(tmp_path):
    """A range that never closed (a module forward that raised: checkpoint's early stop) is
    never written; its ops are placed in the step window it opened in, and counted."""
    path = write_trace(tmp_path, [
        step_node(4, 0), _relu(5, 4, k=10),
        # node 6, a module range opened inside the step, was never written
        _relu(7, 6, k=20), node(8, "## module:x ##", parent=6), _relu(9, 8, k=30),
        _relu(10, 4, k=40),
        _relu(12, 3, k=50),  # under a range (3) opened before the step: not placed
        _relu(13, k=60),     # after the step, under no range: set-up
    ])
    trace = load_trace(path)
    assert [(op.node_id, op.step) for op in trace.ops] == [(5, 0), (7, 0), (9, 0), (10, 0)]
    assert trace.meta["num_orphan_ops"] == 2
    assert trace.meta["num_dropped_ops"] == 2
    assert trace.meta["dropped_ops"] == {"aten::relu": [2, 2 * 4 * 4]}


def test_an_iteration_with_no_op_is_refused(tmp_path):
    """ProfilerStep windows that hold none of the recorded ops: the ops of the measured
    iteration are lost, said with the file and the windows."""
    path = write_trace(tmp_path, [step_node(4, 0), _relu(5, k=10), _relu(6, k=20)])
    with pytest.raises(TraceError, match=r"all 2 recorded ops \(aten::relu, \.\.\.\) lie outside "
                                         r"the trace's 1 ProfilerStep window\(s\) "
                                         r"\(ProfilerStep#0\)"):
        load_trace(path)


@pytest.mark.parametrize("folder", ["gpt_dp_4", "gpt_zero3_leaf_2"])
def test_the_loader_keeps_the_backward_markers(folder):
    """Trace.backward_marks: every ``## module_bwd_begin/end:<qualname> ##`` node of the raw
    file between the first and the last op kept, in id order (ZeRO-3 reads them there)."""
    from actors.trace.conventions import parse_module_range
    path = REPO / "demo" / "traces" / folder / "rank-0.et.json.gz"
    trace = load_trace(path)
    first, last = trace.ops[0].node_id, trace.ops[-1].node_id
    raw = sorted((n["id"], *parse_module_range(n["name"])) for n in read_json(path)["nodes"]
                 if n["name"].startswith(("## module_bwd_begin:", "## module_bwd_end:"))
                 and first < n["id"] < last)
    assert len(raw) > 10 and {kind for _, _, kind in raw} == {"bwd_begin", "bwd_end"}
    assert list(trace.backward_marks) == raw
