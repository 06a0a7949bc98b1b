"""workload.parallelism: degrees and their checks, rank coordinates and roles, the mesh built
on the fake process group, process-group names and DTensor frames in a fake trace."""
from __future__ import annotations

import copy
import gc

import pytest
import torch.distributed as dist

from actors.capture.fake.group_names import group_table, name_c10d_groups, rank_renamer, \
    rename_map
from actors.capture.workloads.mesh import (ParallelismConfig, build_mesh, coordinates, dp_index,
                                           rank_roles, sub_mesh, validate_parallelism)
from actors.capture.fake.fake_mode import strip_dispatch_mode_nodes
from actors.capture.fake.subclass_frames import mark_subclass_frames
from actors.capture.workloads.config import WorkloadConfig
from actors.errors import ConfigError, TracefleetError

LLAMA = dict(model="llama", parallel="fsdp2", precision="bf16_mixed", vocab=64, d_model=64,
             n_layers=2, n_heads=4, seq_len=32, batch_size=2)


def _wl(**parallelism):
    return WorkloadConfig(**LLAMA, parallelism=ParallelismConfig(**parallelism))


def test_dp_shard_takes_the_rest_and_the_product_must_be_the_world():
    par = ParallelismConfig(tp=2, dp_replicate=2)
    assert par.degrees(16) == {"pp": 1, "dp_replicate": 2, "dp_shard": 4, "cp": 1, "tp": 2}
    assert par.describe(16) == "dp_replicate 2 x dp_shard 4 x tp 2"
    with pytest.raises(ConfigError, match=r"must equal world_size=6: 6 is not divisible by 4"):
        par.degrees(6)
    with pytest.raises(ConfigError, match=r"dp_shard\(3\) x cp\(1\) x tp\(2\) must equal "
                                          r"world_size=8 = 6"):
        ParallelismConfig(tp=2, dp_shard=3).degrees(8)
    with pytest.raises(ConfigError, match="parallelism.tp=0: must be >= 1"):
        ParallelismConfig(tp=0).degrees(8)
    assert ParallelismConfig().is_one_dim() and not par.is_one_dim()
    with pytest.raises(ConfigError, match="pp_schedule='zb'"):
        ParallelismConfig(pp_schedule="zb")


@pytest.mark.parametrize("fields, parallelism, world, message", [
    ({}, {"tp": 8}, 16, r"n_heads=4 and n_kv_heads=4 must be divisible by tp=8"),
    ({"seq_len": 36}, {"cp": 4}, 16, r"seq_len=36 must be divisible by tp x 2 cp = 8"),
    ({"vocab": 66}, {"tp": 4}, 16, r"vocab=66 is not divisible by tp=4"),
    # no dp rank: no FSDP2, as torchtitan, whose mixed precision and knobs are FSDP2's
    ({}, {"tp": 4, "dp_shard": 1}, 4, r"no FSDP2 shards the parameters .*precision=bf16_mixed"),
    ({"precision": "fp32", "cpu_offload": True}, {"tp": 2, "pp": 2}, 4,
     r"workload.cpu_offload=True is FSDP2's"),
])
def test_what_cannot_split_is_refused(fields, parallelism, world, message):
    cfg = WorkloadConfig(**{**LLAMA, **fields}, parallelism=ParallelismConfig(**parallelism))
    with pytest.raises(ConfigError, match=message):
        validate_parallelism(cfg, world)


def test_a_mesh_needs_fsdp2_and_the_llama_recipe():
    with pytest.raises(ConfigError, match="needs workload.parallel=fsdp2"):
        validate_parallelism(WorkloadConfig(**{**LLAMA, "parallel": "ddp"},
                                            parallelism=ParallelismConfig(tp=2)), 4)
    validate_parallelism(_wl(tp=2), 4)  # passes
    validate_parallelism(_wl(), 3)  # 1-D: any world
    unsharded = WorkloadConfig(**{**LLAMA, "precision": "fp32"},
                               parallelism=ParallelismConfig(tp=2, pp=2))
    validate_parallelism(unsharded, 4)  # tp x pp, no FSDP2 (as torchtitan)


def test_coordinates_roles_and_data_ranks():
    par = ParallelismConfig(dp_replicate=2, cp=2, tp=2)  # world 16: dp_shard 2
    assert coordinates(par, 16, 13) == {"pp": 0, "dp_replicate": 1, "dp_shard": 1, "cp": 0,
                                        "tp": 1}
    # tp and cp peers read the same data; the dp index runs over replicas and shards
    assert {dp_index(par, 16, r) for r in (12, 13, 14, 15)} == {3}
    assert [dp_index(par, 16, r) for r in (0, 4, 8, 12)] == [0, 1, 2, 3]
    roles = rank_roles(par, 16)
    assert roles == {"cp rank 0": [0, 1, 4, 5, 8, 9, 12, 13],
                     "cp rank 1": [2, 3, 6, 7, 10, 11, 14, 15]}
    assert rank_roles(ParallelismConfig(tp=2), 8) == {"every rank": list(range(8))}


@pytest.fixture
def fake_rank():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def start(rank, world):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    yield start
    if dist.is_initialized():
        dist.destroy_process_group()


def test_the_mesh_has_torchtitans_names_and_flattened_dims(fake_rank):
    fake_rank(13, 16)
    par = ParallelismConfig(dp_replicate=2, cp=2, tp=2)
    mesh = build_mesh("cpu", par, 16)
    assert mesh.mesh_dim_names == ("dp_replicate", "dp_shard", "cp", "tp")
    assert mesh["tp"].mesh.tolist() == [12, 13]
    hsdp = sub_mesh(mesh, par, 16, "dp_replicate", "dp_shard_cp")
    assert hsdp.mesh_dim_names == ("dp_replicate", "dp_shard_cp")
    assert hsdp.mesh.tolist() == [[1, 3, 5, 7], [9, 11, 13, 15]]
    assert sub_mesh(mesh, par, 16, "dp").mesh.tolist() == [1, 5, 9, 13]
    assert sub_mesh(mesh, par, 16, "pp") is None


def test_a_one_dim_job_keeps_the_plain_world_mesh(fake_rank):
    fake_rank(0, 4)
    mesh = build_mesh("cpu", ParallelismConfig(), 4)
    assert mesh.ndim == 1 and mesh.mesh_dim_names is None and mesh.size() == 4
    # only dp_shard: FSDP's mesh is that mesh, a flattened one is the same
    assert sub_mesh(mesh, ParallelismConfig(), 4, "dp_replicate", "dp_shard_cp") is mesh


def _pg(name, desc, ranks):
    return {"pg_name": name, "pg_desc": desc, "backend_config": "cpu:fake", "ranks": ranks,
            "group_size": len(ranks) or 4, "group_count": 3}


def _doc(table, nodes):
    import orjson

    init = {"id": 3, "name": "## process_group:init ##", "ctrl_deps": 1,
            "inputs": {"values": [orjson.dumps(table).decode()], "types": ["String"]},
            "outputs": {"values": [], "types": []}, "attrs": []}
    return {"nodes": [init, *nodes]}


def _op(nid, name, values, types, schema):
    return {"id": nid, "name": name, "ctrl_deps": 1, "attrs": [{"name": "op_schema",
            "type": "string", "value": schema}],
            "inputs": {"values": values, "types": types}, "outputs": {"values": [], "types": []}}


AG = ("c10d::_allgather_base_(Tensor output_tensor, Tensor input_tensor, "
      "__torch__.torch.classes.c10d.ProcessGroup process_group, bool async_op=True, "
      "int timeout=-1) -> (Tensor, __torch__.torch.classes.c10d.Work)")
FAG = "_c10d_functional::all_gather_into_tensor(Tensor input, int group_size, str group_name) -> Tensor"


def test_c10d_groups_are_named_and_a_trace_becomes_another_ranks():
    rank0 = [_pg("0", "default_pg", []), _pg("1", "mesh_dp", [0, 2]), _pg("3", "mesh_tp", [0, 1])]
    rank3 = [_pg("0", "default_pg", []), _pg("2", "mesh_dp", [1, 3]), _pg("4", "mesh_tp", [2, 3])]
    t = [1, 1, 0, 4, 4, "cpu"]
    doc = _doc(rank0, [_op(5, "c10d::_allgather_base_", [t, t, "<Object>", False, -1],
                           ["Tensor(float)", "Tensor(float)", "Object", "Bool", "Int"], AG),
                       _op(7, "_c10d_functional::all_gather_into_tensor", [t, 2, "3"],
                           ["Tensor(float)", "Int", "String"], FAG)])
    with pytest.raises(TracefleetError, match="the trace holds 1 c10d collectives with a "
                                              "process group, the capture dispatched 2"):
        name_c10d_groups(doc, [("c10d::_allgather_base_", "1")] * 2, "test")
    assert name_c10d_groups(doc, [("c10d::_allgather_base_", "1")], "test") == 1
    assert doc["nodes"][1]["inputs"]["values"][2] == "1"
    rename = rank_renamer(group_table(doc["nodes"]), rank3, "test")
    other = [rename(n) for n in doc["nodes"]]
    assert other[1]["inputs"]["values"][2] == "2"  # dp group of rank 3
    assert other[2]["inputs"]["values"][2] == "4"  # its tp group
    assert group_table(other) == rank3
    assert doc["nodes"][1]["inputs"]["values"][2] == "1"  # the source is left as it was
    with pytest.raises(TracefleetError, match="share the description 'mesh_dp'"):
        rename_map(rank0, rank3 + [_pg("9", "mesh_dp", [1, 3])], "test")


def test_a_call_a_dispatch_mode_passed_on_is_one_call_with_two_nodes():
    """Selective activation checkpointing's mode passes FSDP2's all-gather of a unit nested in
    a checkpointed block on to the fake mode: the call's node holds its re-dispatch (through
    a PythonSubclass frame); the fake mode logs it once, and both nodes get its group."""
    t = [1, 1, 0, 4, 4, "cpu"]

    def gather(nid, parent=1):
        return {**_op(nid, "c10d::_allgather_base_", [t, t, "<Object>", False, -1],
                      ["Tensor(float)", "Tensor(float)", "Object", "Bool", "Int"], AG),
                "ctrl_deps": parent}

    frame = {**_op(6, "PythonSubclass", [], [], ""), "ctrl_deps": 5}
    doc = _doc([_pg("0", "default_pg", [])], [gather(5), frame, gather(7, 6), gather(9)])
    log = [("c10d::_allgather_base_", "1"), ("c10d::_allgather_base_", "2")]
    assert name_c10d_groups(doc, log, "test") == 2
    assert [n["inputs"]["values"][2] for n in doc["nodes"] if n["id"] in (5, 7, 9)] == \
        ["1", "1", "2"]


def _frame_doc(child_storage):
    """A composite op over a DTensor op (inputs on wrapper storage 100) with a
    PythonDispatchMode frame over one child op reading ``child_storage``, and the fake mode's
    kernel (meta) below that."""
    def n(nid, name, parent, storage, device="cpu"):
        value = [nid, storage, 0, 4, 4, device]
        op = not name.startswith("Python")
        return {"id": nid, "name": name, "ctrl_deps": parent,
                "attrs": [{"name": "op_schema", "type": "string", "value": "x" if op else ""}],
                "inputs": {"values": [value], "types": ["Tensor(float)"]},
                "outputs": {"values": [value], "types": ["Tensor(float)"]}}
    return {"nodes": [n(9, "aten::type_as", 2, 100), n(10, "aten::_to_copy", 9, 100),
                      n(11, "PythonDispatchMode", 10, 100),
                      n(12, "aten::_to_copy", 11, child_storage),
                      n(13, "PythonDispatchMode", 12, child_storage),
                      n(14, "aten::empty_strided", 13, 7, "meta")]}


def test_a_dtensor_frame_is_told_from_a_decomposition():
    local = _frame_doc(child_storage=55)  # DTensor ran its local op on storage 55
    assert mark_subclass_frames(local) == 1
    frame = local["nodes"][2]
    # named as on a real device, and hung under the top-level op the loader replaces
    assert frame["name"] == "PythonSubclass" and frame["ctrl_deps"] == 9
    decomposed = _frame_doc(child_storage=100)  # the fake mode decomposed the op itself
    assert mark_subclass_frames(decomposed) == 0
    assert decomposed["nodes"][2]["name"] == "PythonDispatchMode"


def test_the_trace_rewrites_leave_no_garbage_cycle():
    """The capture runs with the cyclic GC paused (actors/capture/mesh_world.py): a rewrite
    that leaves a reference cycle holding the parsed trace keeps all of it (7 GB a 405B
    pipeline stage) until the capture ends."""
    doc = _frame_doc(child_storage=55)
    doc["nodes"] += [dict(copy.deepcopy(doc["nodes"][-1]), id=1000 + i) for i in range(500)]
    for node in doc["nodes"]:  # what the doc's garbage would be recognised by
        node["gc_probe"] = True
    was_enabled, flags = gc.isenabled(), gc.get_debug()
    gc.disable()
    try:
        gc.collect()
        gc.garbage.clear()
        mark_subclass_frames(doc)
        strip_dispatch_mode_nodes(doc)
        del doc
        gc.set_debug(gc.DEBUG_SAVEALL)  # what a collection finds stays in gc.garbage
        gc.collect()
        # only the doc's own nodes count: other threads' cyclic garbage (Ray's, a pool's)
        # may be collected here too on a busy worker
        kept = [o for o in gc.garbage if isinstance(o, dict) and o.get("gc_probe")]
        assert not kept, f"{len(kept)} trace nodes were held by a reference cycle"
    finally:
        gc.set_debug(flags)
        gc.garbage.clear()
        if was_enabled:
            gc.enable()
