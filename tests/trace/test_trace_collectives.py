"""Collective normalization: NCCL (record_param_comms) and gloo (c10d::*, functional) alike."""
from __future__ import annotations

from functools import lru_cache

import orjson
import pytest

from actors.trace import Collective, load_trace
from tests.support.et_json import (ALLGATHER_BASE, FUNC_ALL_GATHER, FUNC_WAIT, flat_node, node, scalar, tensor,
                     tensor_list, write_trace)

DLRM_UNEVEN_IN_SPLITS = (96, 224, 288, 1664, 592, 96, 192, 240)
# What every call of a kind must populate, whichever the trace shape.
MESSAGE_FIELDS = ("kind", "dtype", "in_nelems", "out_nelems", "in_splits", "out_splits", "root",
                  "async_op")
GROUP_FIELDS = ("pg_name", "group_size")


@lru_cache(maxsize=None)
def _load(path: str):
    return load_trace(path)


def _calls(trace, kind) -> list[Collective]:
    return [op.collective for op in trace.collectives if op.collective.kind == kind]


def _populated(c: Collective, fields) -> dict:
    """Per field: its type and whether it holds a value (None and () are empty)."""
    return {f: (type(getattr(c, f)).__name__, getattr(c, f) not in (None, ())) for f in fields}


# ---------------------------------------------------------------- gloo capture vs NCCL traces

@pytest.mark.parametrize("kind", ["all_reduce", "broadcast"])
def test_gloo_and_nccl_collectives_populate_the_same_fields(gloo_trace_dir, public_trace_dir, kind):
    gloo = _calls(_load(str(gloo_trace_dir / "rank-0.json")), kind)[0]
    nccl = _calls(_load(str(public_trace_dir / "resnet_et.json.gz")), kind)[0]
    assert _populated(gloo, MESSAGE_FIELDS) == _populated(nccl, MESSAGE_FIELDS)
    assert (gloo.source, nccl.source) == ("c10d", "record_param_comms")
    # a gloo c10d op shows its group only as "<Object>": the replay maps it (group_map)
    assert all(getattr(gloo, f) is None for f in GROUP_FIELDS)
    assert all(getattr(nccl, f) is not None for f in GROUP_FIELDS)


def test_functional_gloo_collectives_name_their_group_like_nccl(gloo_trace_dir, public_trace_dir):
    fields = MESSAGE_FIELDS[1:] + GROUP_FIELDS  # kinds differ: no functional all_reduce captured
    nccl = _calls(_load(str(public_trace_dir / "resnet_2gpu_et.json.gz")), "all_reduce")[0]
    trace = _load(str(gloo_trace_dir / "rank-0.json"))
    functional = [op.collective for op in trace.collectives
                  if op.collective.source == "functional" and op.collective.kind != "wait"]
    assert len(functional) == 2
    for c in functional:
        assert _populated(c, fields) == _populated(nccl, fields)
        assert (c.pg_name, c.group_size, c.async_op) == ("0", 2, True)


def test_gloo_and_dlrm_all_to_all_populate_the_same_fields(gloo_trace_dir, dlrm_rank_dir):
    gloo = _calls(_load(str(gloo_trace_dir / "rank-0.json")), "all_to_all_single")[0]
    dlrm = next(c for c in _calls(_load(str(dlrm_rank_dir / "rank-0.json")), "all_to_all_single")
                if c.in_splits)
    assert _populated(gloo, MESSAGE_FIELDS) == _populated(dlrm, MESSAGE_FIELDS)
    assert all(type(s) is int for c in (gloo, dlrm) for s in c.in_splits + c.out_splits)


def test_waits_look_alike(gloo_trace_dir, public_trace_dir):
    """A wait completes a call and carries no message, from record_param_comms or wait_tensor."""
    nccl = _calls(_load(str(public_trace_dir / "resnet_et.json.gz")), "wait")
    gloo = _calls(_load(str(gloo_trace_dir / "rank-0.json")), "wait")
    assert len(gloo) == 2 and nccl
    for c in nccl + gloo:
        assert (c.dtype, c.in_nelems, c.out_nelems, c.async_op, c.seq) == (None, 0, 0, None, None)
        assert c.wait_seq is not None


def test_gloo_capture(gloo_trace_dir):
    world = 2
    for r in range(world):
        trace = _load(str(gloo_trace_dir / f"rank-{r}.json"))
        assert trace.schema.startswith("1.1.1") and trace.rank == r
        assert [(g.name, g.group_size) for g in trace.process_groups] == [("0", world)]
        calls = [op.collective for op in trace.collectives]
        assert [c.kind for c in calls] == [
            "all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast",
            "all_to_all_single", "all_reduce", "scatter", "all_gather_into_tensor", "wait",
            "reduce_scatter_tensor", "wait"]
        grad, gather, shard, bcast, a2a, async_reduce, scatter, f_gather, _, f_shard, _ = calls
        assert (grad.dtype, grad.in_nelems, grad.out_nelems, grad.async_op) == ("float32", 64, 64, False)
        assert async_reduce.async_op is True and async_reduce.in_nelems == 8
        assert (gather.in_nelems, gather.out_nelems) == (8, 8 * world)
        assert (shard.in_nelems, shard.out_nelems) == (4 * world, 4)
        assert (bcast.root, bcast.in_nelems) == (0, 8)
        assert a2a.dtype == "int64"
        assert a2a.in_splits == tuple(1 + j + 2 * r for j in range(world))
        assert a2a.out_splits == tuple(1 + r + 2 * j for j in range(world))
        assert (a2a.in_nelems, a2a.out_nelems) == (sum(a2a.in_splits), sum(a2a.out_splits))
        # the non-root scatter rank passes no input list: dtype and size come from the output
        assert (scatter.dtype, scatter.root, scatter.out_nelems) == ("float64", 0, 3)
        assert scatter.in_nelems == (3 * world if r == 0 else 0)
        # functional collectives return their result: it sizes the received message
        assert (f_gather.in_nelems, f_gather.out_nelems) == (5, 5 * world)
        assert (f_shard.in_nelems, f_shard.out_nelems) == (6 * world, 6)


def test_functional_waits_pair_with_their_calls(gloo_trace_dir):
    for r in range(2):
        ops = _load(str(gloo_trace_dir / f"rank-{r}.json")).collectives
        calls = [op.collective.seq for op in ops if op.collective.source == "functional"
                 and op.collective.kind != "wait"]
        waits = [op.collective.wait_seq for op in ops if op.collective.kind == "wait"]
        assert waits == calls and all(s[0] == "uid" for s in calls)


def test_wait_tensor_nested_in_its_collective_is_a_call(tmp_path):
    """The observer may record a functional wait_tensor as a child of the call it waits for."""
    path = write_trace(tmp_path, [
        node(3, "_c10d_functional::all_gather_into_tensor", schema=FUNC_ALL_GATHER,
             inputs=[tensor(1, 1, 4), scalar(2), scalar("0", "String")], outputs=[tensor(2, 2, 8)]),
        node(4, "aten::empty", parent=3, schema="aten::empty(SymInt[] size) -> Tensor",
             inputs=[scalar([8], "GenericList[Int]")], outputs=[tensor(2, 2, 8)]),
        node(5, "_c10d_functional::wait_tensor", parent=3, schema=FUNC_WAIT,
             inputs=[tensor(2, 2, 8)], outputs=[tensor(2, 2, 8)]),
    ])
    call, wait = [op.collective for op in load_trace(path).ops]
    assert (call.kind, call.in_nelems, call.out_nelems, call.pg_name, call.group_size) == \
           ("all_gather_into_tensor", 4, 8, "0", 2)
    assert wait.kind == "wait" and wait.wait_seq == call.seq and call.async_op is True


# ---------------------------------------------------------------- record_param_comms without attrs

def test_dlrm_uneven_all_to_allv(dlrm_rank_dir):
    traces = [_load(str(dlrm_rank_dir / f"rank-{r}.json")) for r in range(8)]
    a2a = [_calls(t, "all_to_all_single") for t in traces]
    uneven = a2a[0][3]
    assert (uneven.dtype, uneven.in_splits, uneven.out_splits) == ("int32", DLRM_UNEVEN_IN_SPLITS, (96,) * 8)
    assert (uneven.in_nelems, uneven.out_nelems) == (3392, 768)
    for pos in range(5):  # what rank i sends to j is what j receives from i
        calls = [a2a[r][pos] for r in range(8)]
        for i, c in enumerate(calls):
            if c.in_splits:
                assert (sum(c.in_splits), sum(c.out_splits)) == (c.in_nelems, c.out_nelems)
                assert all(c.in_splits[j] == calls[j].out_splits[i] for j in range(8))
            else:
                assert c.in_nelems == c.out_nelems
    waits = _calls(traces[0], "wait")
    # two complete calls issued before the trace started; the KJT lengths/values all_to_alls
    # (seq 149, 150) are waited for after it ended; DDP's all_reduce calls are never waited for
    assert [c.wait_seq for c in waits] == [141, 142, 147, 148, 152]
    assert [(c.seq, c.async_op) for c in a2a[0]] == [(147, True), (148, True), (149, False),
                                                     (150, False), (152, True)]
    assert [c.async_op for c in _calls(traces[0], "all_reduce")] == [False] * 3


def test_1_0_1_record_param_comms_without_outputs(dlrm_rank_dir, tmp_path):
    """Without attrs or outputs, record_param_comms knows only what it sends: sizes come from
    the c10d op's input and output arguments."""
    doc = orjson.loads((dlrm_rank_dir / "rank-0.json").read_bytes())
    for n in doc["nodes"]:
        if n["name"] == "record_param_comms":
            n["outputs"], n["output_shapes"], n["output_types"] = [], [], []
    stripped = tmp_path / "rank-0.json"
    stripped.write_bytes(orjson.dumps(doc))
    want = [(c.kind, c.dtype, c.in_nelems, c.out_nelems, c.in_splits, c.out_splits)
            for c in (op.collective for op in _load(str(dlrm_rank_dir / "rank-0.json")).collectives)]
    got = [(c.kind, c.dtype, c.in_nelems, c.out_nelems, c.in_splits, c.out_splits)
           for c in (op.collective for op in load_trace(stripped).collectives)]
    assert got == want and (3392, 768) in {(w[2], w[3]) for w in want}


def test_1_0_1_all_gather_sized_by_the_c10d_op(tmp_path):
    world = 4
    path = write_trace(tmp_path, [
        flat_node(3, "c10d::_allgather_base_", schema=ALLGATHER_BASE,
                  inputs=[tensor(1, 1, 6 * world), tensor(2, 2, 6), scalar("<Object>", "Object"),
                          scalar(False, "Bool"), scalar(-1)],
                  outputs=[tensor(1, 1, 6 * world), scalar("<Object>", "Object")]),
        # as old observers wrote it: the input only, no output tensor, no attrs
        flat_node(4, "record_param_comms", parent=3,
                  inputs=[tensor(2, 2, 6), scalar(7), scalar(94594108284448), scalar(0),
                          scalar("_allgather_base", "String"), scalar([], "GenericList[]"),
                          scalar([], "GenericList[]")]),
    ], schema="1.0.1")
    (op,) = load_trace(path).ops
    c = op.collective
    assert (c.kind, c.source, c.dtype, c.seq) == ("all_gather_into_tensor", "record_param_comms", "float32", 7)
    assert (c.in_nelems, c.out_nelems, c.async_op) == (6, 6 * world, False)


def test_rpc_attrs_win_over_the_c10d_op(tmp_path):
    """1.1.0+ record_param_comms counts are what the collective used; the c10d op's tensor lists
    may be cut (the observer stops at 4096 entries): here it shows 2 of the 4 gathered tensors."""
    rpc_attrs = dict(collective_name="allgather", dtype="Float", in_msg_nelems=3, out_msg_nelems=12,
                     pg_name="0", pg_desc="default_pg", pg_size=4)
    schema = ("c10d::allgather_(Tensor[][] output_tensors, Tensor[] input_tensors, "
              "__torch__.torch.classes.c10d.ProcessGroup process_group, bool async_op=True, "
              "int timeout=-1) -> (Tensor[][], __torch__.torch.classes.c10d.Work)")
    cut = tensor_list(tensor(10, 10, 3), tensor(11, 11, 3))
    nested = ([cut[0]], [cut[1]], f"GenericList[{cut[2]}]")
    path = write_trace(tmp_path, [
        node(3, "c10d::allgather_", schema=schema,
             inputs=[nested, tensor_list(tensor(1, 1, 3)), scalar("<Object>", "Object"),
                     scalar(True, "Bool"), scalar(-1)],
             outputs=[nested, scalar("<Object>", "Object")]),
        node(4, "record_param_comms", parent=3, inputs=[tensor_list(tensor(1, 1, 3)), scalar(9)],
             outputs=[cut], **rpc_attrs),
    ])
    c = load_trace(path).ops[0].collective
    assert (c.kind, c.in_nelems, c.out_nelems, c.pg_name, c.group_size, c.async_op) == \
           ("all_gather", 3, 12, "0", 4, True)
