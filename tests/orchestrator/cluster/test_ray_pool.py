"""Independent work as Ray tasks spread over a two-node cluster (orchestrator/cluster/
ray_pool.py): a mesh job's roles land on both nodes and their files come back; a fit search's
axes answer as they do one after another, their probes reported as they finish."""
from __future__ import annotations

import json
import sys

import pytest
import ray.cloudpickle
from tests.support.ray_nodes import two_node_cluster  # noqa: F401 (fixture)

from actors.errors import TracefleetError
from actors.trace import load_trace
from actors.trace.conventions import trace_file_name
from orchestrator.cli.predict import predict_config
from orchestrator.cluster.ray_pool import in_ray_tasks
from orchestrator.config import ClusterConfig
from orchestrator.run.roles_config import RolesConfig
from orchestrator.studies.fit_search import fit_search
from tests.orchestrator.run.test_roles import WORLD_SIZE, _capture

pytestmark = [pytest.mark.slow, pytest.mark.long]  # two-node clusters: CI's second job
# Ray workers cannot import modules under tests/: ship this one's functions by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _ops(out_dir) -> list[list[str]]:
    return [[op.name for op in load_trace(out_dir / trace_file_name(rank)).ops]
            for rank in range(WORLD_SIZE)]


def test_roles_land_on_both_nodes_and_their_files_come_back(two_node_cluster,  # noqa: F811
                                                             tmp_path):
    _capture(tmp_path / "in_order", RolesConfig(num_workers=1))
    meta = _capture(tmp_path / "on_ray", RolesConfig(num_workers=2, executor="ray",
                                                     ray_address=two_node_cluster.address))
    nodes = [r["node_id"] for r in meta["role_recordings"]]
    assert len(set(nodes)) == 2, nodes
    # the files were written on the nodes' own folders and shipped through the object store
    assert _ops(tmp_path / "on_ray") == _ops(tmp_path / "in_order")
    on_disk = json.loads((tmp_path / "on_ray" / "meta.json").read_text())
    assert [r["node_id"] for r in on_disk["role_recordings"]] == nodes


def _fails(value: int) -> int:
    if value == 2:
        raise TracefleetError("two is refused")
    if value == 3:
        raise ValueError("three is not a number here")
    return value


@pytest.mark.parametrize("value, match", [
    (2, r"^two is refused$"),  # a task's own error, as it is
    (3, r"^task 0 failed on Ray: ValueError: three is not a number here"),
])
def test_a_failed_task_is_named(two_node_cluster, value, match):  # noqa: F811
    with pytest.raises(TracefleetError, match=match):
        list(in_ray_tasks(_fails, [(value,)], 1, ClusterConfig(address=two_node_cluster.address),
                          60, lambda i: f"task {i}"))


def test_fit_search_axes_on_ray_answer_as_one_after_another(two_node_cluster,  # noqa: F811
                                                            tmp_path):
    small = [f"workload.{k}={v}" for k, v in dict(
        vocab=4096, d_model=512, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=2048,
        seq_len=1024, batch_size=1).items()]
    runs = {}  # one after another in this process, then the axes as two Ray tasks
    for executor, workers in (("local", 1), ("ray", 2)):
        seen = []
        cfg = predict_config(
            "experiment=fit_search", "workload=llama3_8b", "world_size=4",
            f"predict.cache_dir={tmp_path}", "target=custom", "target.device_memory=1GiB",
            "target.cuda_context=0", "target.nccl_num_peers=0", *small,
            "fit_search.axes=[batch_size,activation_checkpointing]",
            "fit_search.max_batch_size=4", f"fit_search.num_workers={workers}",
            f"fit_search.executor={executor}",
            f"fit_search.ray_address={two_node_cluster.address}")
        answers = fit_search(cfg, on_probe=seen.append)
        runs[executor] = ([(a.axis, a.best, a.first_failing, a.num_probes) for a in answers],
                          sorted((r["axis"], str(r["value"]), r["verdict"],
                                  r["predicted_reserved_peak_bytes"]) for r in seen))
    assert runs["ray"] == runs["local"]
    assert len(runs["ray"][1]) >= 3  # every probe reached on_probe, from the nodes
