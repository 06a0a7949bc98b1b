"""Driver pre-flight (orchestrator.preflight.validate) on captured gloo traces and public NCCL traces:
layouts, the recorded world, subsets per mode, mismatches refused or warned per mode."""
import json
import shutil
from datetime import timedelta
from pathlib import Path

import pytest

from actors.errors import ConfigError, TraceError
from actors.trace import Trace
from actors.trace.source import discover
from orchestrator.preflight.validate import preflight



def _capture(rank, world, init_file, out_dir):
    import torch
    import torch.distributed as dist
    from torch.profiler import ExecutionTraceObserver

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=30))
    et = ExecutionTraceObserver()
    et.register_callback(f"{out_dir}/rank-{rank}.et.json")
    et.start()
    x = torch.ones(8)
    dist.all_reduce(x)
    dist.all_gather_into_tensor(torch.empty(8 * world), x)
    ins, outs = ([3, 1], [3, 2]) if rank == 0 else ([2, 4], [1, 4])
    dist.all_to_all_single(torch.empty(sum(outs)), torch.ones(sum(ins)), outs, ins)
    if rank == 0:
        dist.send(x, 1)  # point-to-point: not part of the group's sequence
    else:
        dist.recv(x, 0)
    dist.broadcast(x, src=1)
    dist.barrier()
    et.stop()
    et.unregister_callback()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    import torch.multiprocessing as mp
    out = tmp_path_factory.mktemp("gloo2")
    mp.spawn(_capture, args=(2, str(out / "init"), str(out)), nprocs=2, join=True)
    (out / "init").unlink(missing_ok=True)
    return out


def copy_ranks(src: Path, dst: Path, names: dict[int, str] | None = None) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    names = {0: "rank-0.et.json", 1: "rank-1.et.json"} if names is None else names
    for rank, name in names.items():
        shutil.copy(src / f"rank-{rank}.et.json", dst / name)
    return dst


def edit_nodes(path: Path, name: str, edit) -> None:
    """Apply ``edit(node)`` to the first node called ``name`` in a trace file."""
    doc = json.loads(path.read_text())
    node = next(n for n in sorted(doc["nodes"], key=lambda n: n["id"]) if n["name"] == name)
    edit(node)
    path.write_text(json.dumps(doc))


def test_good_folder_passes_and_keeps_no_trace(good):
    res = preflight(good, 2, executor="processes", num_workers=2)
    assert res.world_size == 2 and res.ranks == [0, 1] and res.recorded_world_size == 2
    assert [s.path for s in res.sources] == [str(good / "rank-0.et.json"), str(good / "rank-1.et.json")]
    assert [g.name for g in res.process_groups] == ["0"]
    assert res.num_collectives == {"0": 5}  # all_reduce, all_gather, all_to_all, broadcast, barrier
    assert res.warnings == []
    assert not any(isinstance(v, (Trace, list)) and v and isinstance(v[0], Trace)
                   for v in vars(res).values())  # the driver holds signatures, not traces
    inline = preflight(good, None, executor="inline")
    assert (inline.world_size, inline.num_collectives) == (2, res.num_collectives)


@pytest.mark.parametrize("requested,msg", [
    (1, "has 2 ranks to replay; a run on 1 ranks cannot replay it"),
    (3, "3 ranks was requested but .* holds traces for 2 ranks"),
])
def test_world_size_other_than_the_traces_is_refused(good, requested, msg):
    with pytest.raises(ConfigError, match=msg):
        preflight(good, requested, executor="inline")


@pytest.mark.parametrize("names,msg", [
    ({1: "rank-1.et.json"}, r"world size 2, but .* gives rank\(s\) \[1\] \(missing trace files for rank\(s\) \[0\]"),
    ({0: "rank-0.et.json", 1: "rank-3.json"}, r"have rank\(s\) \[3\], but the traces were recorded with world size 2"),
    ({0: "rank-0.et.json", 1: "rank-0.json.gz"}, "rank 0 has two trace files"),
    ({}, "no rank trace files"),
])
def test_folder_layout_errors_name_the_ranks(good, tmp_path, names, msg):
    copy_ranks(good, tmp_path / "d", names)
    with pytest.raises(ConfigError, match=msg):
        preflight(tmp_path / "d", executor="inline")


def test_discovery_reads_the_rank_from_names_and_rejects_missing_dir(tmp_path):
    for name in ("rank-0.json.gz", "rank-1.et.json.gz", "rank-2.json", "dlrm_eg_3.json",
                 "foo_rank_4.json", "notes.txt", "rank-x.json", "meta.json"):
        (tmp_path / name).write_text("{}")
    assert {r: s.name for r, s in discover(tmp_path).items()} == {
        0: "rank-0.json.gz", 1: "rank-1.et.json.gz", 2: "rank-2.json", 3: "dlrm_eg_3.json",
        4: "foo_rank_4.json"}
    with pytest.raises(ConfigError, match="does not exist"):
        discover(tmp_path / "nope")


def test_compute_mode_replays_a_subset_full_and_comms_refuse_it(good, tmp_path):
    copy_ranks(good, tmp_path, {1: "rank-1.et.json"})
    res = preflight(tmp_path, mode="compute", executor="inline")
    assert (res.world_size, res.ranks, res.recorded_world_size) == (1, [1], 2)
    for mode in ("full", "comms"):
        with pytest.raises(ConfigError, match=f"replay.mode={mode} replays collectives, which need "
                                              r"every member .* rank\(s\) \[0\]"):
            preflight(tmp_path, mode=mode, executor="inline")
    res = preflight(good, mode="compute", ranks=[1], executor="inline")
    assert (res.ranks, [s.name for s in res.sources]) == ([1], ["rank-1.et.json"])
    with pytest.raises(ConfigError, match=r"trace.ranks asks for rank\(s\) \[5\], but .* rank\(s\) \[0, 1\]"):
        preflight(good, mode="compute", ranks=[1, 5], executor="inline")
    with pytest.raises(ConfigError, match="needs? every member"):
        preflight(good, mode="full", ranks=[0], executor="inline")


def test_fewer_files_than_the_recorded_world_is_refused_in_full_mode(good, tmp_path):
    copy_ranks(good, tmp_path, {0: "rank-0.et.json"})
    with pytest.raises(ConfigError, match=r"recorded with world size 2, but .* \(missing trace "
                                          r"files for rank\(s\) \[1\]"):
        preflight(tmp_path, None, executor="inline")


def test_without_process_groups_the_world_is_what_meta_json_records(good, tmp_path):
    """A trace that records no process group (group "0") takes its world from the capture's
    meta.json: a missing rank is named, not replayed as a smaller job."""
    copy_ranks(good, tmp_path, {0: "rank-0.et.json"})
    path = tmp_path / "rank-0.et.json"
    doc = json.loads(path.read_text())
    doc["nodes"] = [n for n in doc["nodes"] if n["name"] != "## process_group:init ##"]
    path.write_text(json.dumps(doc))
    assert preflight(tmp_path, mode="compute", executor="inline").recorded_world_size == 1
    (tmp_path / "meta.json").write_text(json.dumps({"world_size": 2, "ranks": [{"rank": 0}]}))
    assert preflight(tmp_path, mode="compute", executor="inline").recorded_world_size == 2
    with pytest.raises(ConfigError, match=r"recorded with world size 2, but .* \(missing trace "
                                          r"files for rank\(s\) \[1\]"):
        preflight(tmp_path, mode="full", executor="inline")


def _grow_all_gather(tmp_path):
    """All_gather input 8 -> 9 elements on rank 1 only."""
    def grow(node):
        node["inputs"]["values"][1][3] = 9
        node["inputs"]["shapes"][1] = [9]
    edit_nodes(tmp_path / "rank-1.et.json", "c10d::_allgather_base_", grow)


@pytest.mark.parametrize("mode", ["full", "comms"])
def test_mismatched_collective_names_group_position_and_signatures(good, tmp_path, mode):
    copy_ranks(good, tmp_path)
    _grow_all_gather(tmp_path)
    with pytest.raises(ConfigError) as err:
        preflight(tmp_path, 2, mode=mode, executor="inline")
    msg = str(err.value)
    assert "process group '0': collective #1 differs between rank 0" in msg
    assert "'all_gather_into_tensor', 8, 16, 'float32'" in msg and "and rank 1" in msg
    assert "'all_gather_into_tensor', 9, 16, 'float32'" in msg


def test_compute_mode_warns_of_a_mismatch_instead(good, tmp_path, caplog):
    copy_ranks(good, tmp_path)
    _grow_all_gather(tmp_path)
    with caplog.at_level("WARNING", logger="tracefleet"):
        res = preflight(tmp_path, 2, mode="compute", executor="inline")
    assert res.world_size == 2 and len(res.warnings) == 1
    assert "process group '0': collective #1 differs between rank 0" in res.warnings[0]
    assert "replay.mode=compute replays no collective" in res.warnings[0]
    assert res.warnings[0] in caplog.text


def test_a_missing_collective_names_the_first_unmatched_call(good, tmp_path):
    copy_ranks(good, tmp_path)
    doc = json.loads((tmp_path / "rank-1.et.json").read_text())
    doc["nodes"] = [n for n in doc["nodes"] if n["name"] != "c10d::barrier"]
    (tmp_path / "rank-1.et.json").write_text(json.dumps(doc))
    with pytest.raises(ConfigError, match=r"rank 0 has 5 collectives, rank 1 has 4; first unmatched "
                                          r"is #4 on rank 0 \(node \d+ c10d::barrier"):
        preflight(tmp_path, 2, executor="inline")


def test_inconsistent_all_to_all_splits_are_reported(good, tmp_path):
    copy_ranks(good, tmp_path)

    def resplit(node):  # rank 1 now expects 2 (not 1) elements from rank 0
        node["inputs"]["values"][3] = [2, 4]
    edit_nodes(tmp_path / "rank-1.et.json", "c10d::alltoall_base_", resplit)
    with pytest.raises(ConfigError, match="rank 0 sends 1 to rank 1 .* which expects 2"):
        preflight(tmp_path, 2, executor="inline")


def test_unnamed_gloo_collectives_with_subgroups_need_a_group_map(good, tmp_path):
    copy_ranks(good, tmp_path)
    for rank in (0, 1):
        def add_group(node, rank=rank):
            table = json.loads(node["inputs"]["values"][0])
            table.append({"pg_name": str(1 + rank), "pg_desc": "solo", "backend_config": "cpu:gloo",
                          "ranks": [rank], "group_size": 1, "group_count": 3})
            node["inputs"]["values"][0] = json.dumps(table)
        edit_nodes(tmp_path / f"rank-{rank}.et.json", "## process_group:init ##", add_group)
    with pytest.raises(ConfigError, match=r"rank\(s\) \[0, 1\] have collectives .* Pass group_map"):
        preflight(tmp_path, 2, executor="inline")
    res = preflight(tmp_path, 2, group_map={"*": "0"}, executor="inline")
    assert [g.name for g in res.process_groups] == ["0", "1", "2"]
    with pytest.raises(ConfigError, match="not a process group of the trace"):
        preflight(tmp_path, 2, group_map={"*": "9"}, executor="inline")
    with pytest.raises(ConfigError, match="neither '\\*' nor a collective kind"):
        preflight(tmp_path, 2, group_map={"allreduce": "0"}, executor="inline")
    with pytest.raises(ConfigError, match="rank 0, node .* group '2' whose ranks \\[1\\] exclude it"):
        preflight(tmp_path, 2, group_map={"all_reduce": "2", "*": "0"}, executor="inline")


@pytest.mark.parametrize("executor", ["inline", "processes"])
def test_unreadable_file_is_a_trace_error_naming_it(good, tmp_path, executor):
    copy_ranks(good, tmp_path)
    (tmp_path / "rank-1.et.json").write_text('{"schema": "1.1.1-chakra.0.0.4", "nodes": [')
    with pytest.raises(TraceError, match="rank-1.et.json"):
        preflight(tmp_path, 2, executor=executor, num_workers=2)


def test_public_nccl_traces(tmp_path, public_trace_dir, dlrm_rank_dir):
    one = tmp_path / "resnet"
    one.mkdir()
    shutil.copy(public_trace_dir / "resnet_et.json.gz", one / "rank-0.et.json.gz")
    res = preflight(one, 1, executor="inline")
    assert res.world_size == 1 and res.num_collectives == {"0": 21}
    archive = preflight(public_trace_dir / "dlrm_pytorch_et.tar.gz", 8)  # no extraction
    folder = preflight(dlrm_rank_dir, 8)  # uneven all_to_allv splits cross-checked over 8 ranks
    for res in (archive, folder):
        assert res.world_size == 8 and res.num_collectives == {"0": 8} and res.warnings == []
    assert [s.member for s in archive.sources] == [f"dlrm_pytorch_et/dlrm_eg_{r}.json" for r in range(8)]


def test_one_file_of_a_two_gpu_job(public_trace_dir):
    """resnet_2gpu_et.json.gz is rank 1 of 2, alone: compute mode replays it on one actor."""
    path = public_trace_dir / "resnet_2gpu_et.json.gz"
    res = preflight(path, mode="compute")
    assert (res.world_size, res.recorded_world_size, res.warnings) == (1, 2, [])
    with pytest.raises(ConfigError, match=r"taken as rank 0.*missing trace files for rank\(s\) \[1\]"):
        preflight(path, mode="full")


def test_subset_of_the_dlrm_archive(public_trace_dir):
    archive = public_trace_dir / "dlrm_pytorch_et.tar.gz"
    res = preflight(archive, mode="compute", ranks=[0, 3])
    assert (res.world_size, res.ranks, res.recorded_world_size) == (2, [0, 3], 8)
    assert [s.member for s in res.sources] == ["dlrm_pytorch_et/dlrm_eg_0.json",
                                               "dlrm_pytorch_et/dlrm_eg_3.json"]
    with pytest.raises(ConfigError, match=r"missing trace files for rank\(s\) \[1, 2, 4, 5, 6, 7\]"):
        preflight(archive, mode="comms", ranks=[0, 3])
