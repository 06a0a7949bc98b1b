"""Driver pre-flight (orchestrator.validate) on captured gloo traces and public NCCL traces."""
import json
import shutil
import tarfile
from datetime import timedelta
from pathlib import Path

import pytest

from actors.errors import ConfigError, TraceError
from orchestrator.validate import discover_rank_files, preflight



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


def test_good_folder_passes_and_returns_the_loaded_traces(good):
    res = preflight(good, 2, num_workers=2)  # the process-pool path
    assert res.world_size == 2 and sorted(res.rank_files) == [0, 1]
    assert [t.rank for t in res.traces] == [0, 1]
    assert [g.name for g in res.process_groups] == ["0"]
    assert res.num_collectives == {"0": 5}  # all_reduce, all_gather, all_to_all, broadcast, barrier
    kinds = [op.collective.kind for op in res.traces[1].collectives]
    assert "recv" in kinds and "all_to_all_single" in kinds
    assert preflight(good, None, num_workers=1).world_size == 2


@pytest.mark.parametrize("requested,msg", [
    (1, "has 2 ranks; a run on 1 ranks cannot replay it"),
    (3, "3 ranks was requested but .* holds traces for 2 ranks"),
])
def test_world_size_other_than_the_traces_is_refused(good, requested, msg):
    with pytest.raises(ConfigError, match=msg):
        preflight(good, requested, num_workers=1)


@pytest.mark.parametrize("names,msg", [
    ({1: "rank-1.et.json"}, r"missing trace files for rank\(s\) \[0\]"),
    ({0: "rank-0.et.json", 1: "rank-3.json"}, r"rank\(s\) \[1, 2\]"),
    ({0: "rank-0.et.json", 1: "rank-0.json.gz"}, "rank 0 has two trace files"),
    ({}, "no rank trace files"),
])
def test_folder_layout_errors_name_the_ranks(good, tmp_path, names, msg):
    copy_ranks(good, tmp_path / "d", names)
    with pytest.raises(ConfigError, match=msg):
        discover_rank_files(tmp_path / "d")


def test_discovery_accepts_param_names_and_rejects_missing_dir(tmp_path):
    for name in ("rank-0.json.gz", "rank-1.et.json.gz", "rank-2.json", "notes.txt", "rank-x.json"):
        (tmp_path / name).write_text("{}")
    assert [p.name for p in discover_rank_files(tmp_path).values()] == \
        ["rank-0.json.gz", "rank-1.et.json.gz", "rank-2.json"]
    with pytest.raises(ConfigError, match="does not exist"):
        discover_rank_files(tmp_path / "nope")


def test_fewer_files_than_the_recorded_world_is_refused(good, tmp_path):
    copy_ranks(good, tmp_path, {0: "rank-0.et.json"})
    with pytest.raises(ConfigError, match="recorded with world size 2 .* holds 1 rank file"):
        preflight(tmp_path, None, num_workers=1)


def test_mismatched_collective_names_group_position_and_signatures(good, tmp_path):
    copy_ranks(good, tmp_path)

    def grow(node):  # all_gather input 8 -> 9 elements on rank 1
        node["inputs"]["values"][1][3] = 9
        node["inputs"]["shapes"][1] = [9]
    edit_nodes(tmp_path / "rank-1.et.json", "c10d::_allgather_base_", grow)
    with pytest.raises(ConfigError) as err:
        preflight(tmp_path, 2, num_workers=1)
    msg = str(err.value)
    assert "process group '0': collective #1 differs between rank 0" in msg
    assert "'all_gather_into_tensor', 8, 16, 'float32'" in msg and "and rank 1" in msg
    assert "'all_gather_into_tensor', 9, 16, 'float32'" in msg


def test_inconsistent_all_to_all_splits_are_reported(good, tmp_path):
    copy_ranks(good, tmp_path)

    def resplit(node):  # rank 1 now expects 2 (not 1) elements from rank 0
        node["inputs"]["values"][3] = [2, 4]
    edit_nodes(tmp_path / "rank-1.et.json", "c10d::alltoall_base_", resplit)
    with pytest.raises(ConfigError, match="rank 0 sends 1 to rank 1 .* which expects 2"):
        preflight(tmp_path, 2, num_workers=1)


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
        preflight(tmp_path, 2, num_workers=1)
    res = preflight(tmp_path, 2, group_map={"*": "0"}, num_workers=1)
    assert [g.name for g in res.process_groups] == ["0", "1", "2"]
    with pytest.raises(ConfigError, match="not a process group of the trace"):
        preflight(tmp_path, 2, group_map={"*": "9"}, num_workers=1)
    with pytest.raises(ConfigError, match="neither '\\*' nor a collective kind"):
        preflight(tmp_path, 2, group_map={"allreduce": "0"}, num_workers=1)
    with pytest.raises(ConfigError, match="rank 0, node .* group '2' whose ranks \\[1\\] exclude it"):
        preflight(tmp_path, 2, group_map={"all_reduce": "2", "*": "0"}, num_workers=1)


@pytest.mark.parametrize("workers", [1, 2])
def test_unreadable_file_is_a_trace_error_naming_it(good, tmp_path, workers):
    copy_ranks(good, tmp_path)
    (tmp_path / "rank-1.et.json").write_text('{"schema": "1.1.1-chakra.0.0.4", "nodes": [')
    with pytest.raises(TraceError, match="rank-1.et.json"):
        preflight(tmp_path, 2, num_workers=workers)


def test_public_nccl_traces(tmp_path, public_trace_dir):
    one = tmp_path / "resnet"
    one.mkdir()
    shutil.copy(public_trace_dir / "resnet_et.json.gz", one / "rank-0.et.json.gz")
    res = preflight(one, 1, num_workers=1)
    assert res.world_size == 1 and res.num_collectives == {"0": 21}
    dlrm = tmp_path / "dlrm"
    with tarfile.open(public_trace_dir / "dlrm_pytorch_et.tar.gz") as tar:
        tar.extractall(tmp_path, filter="data")
    dlrm.mkdir()
    for r in range(8):
        (tmp_path / "dlrm_pytorch_et" / f"dlrm_eg_{r}.json").rename(dlrm / f"rank-{r}.json")
    res = preflight(dlrm, 8)  # uneven all_to_allv splits cross-checked over 8 ranks
    assert res.world_size == 8 and res.num_collectives == {"0": 8}

