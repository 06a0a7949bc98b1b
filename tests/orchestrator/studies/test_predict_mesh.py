"""tracefleet-predict on a mesh job: one capture per role, one dry run each, the mesh and the
worst rank's role in prediction.json and the table; a mesh that cannot split is refused
before any capture."""
from __future__ import annotations

import pytest

from actors.errors import ConfigError
from orchestrator.cli.predict import predict_config
from orchestrator.reports.predict_table import prediction_table
from orchestrator.studies.predict import predict

TINY = dict(vocab=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, seq_len=32,
            batch_size=1, activation_checkpointing="none")


def _cfg(cache, *overrides):
    return predict_config("workload=llama3_8b", f"predict.cache_dir={cache}", "world_size=4",
                          "target=h100_80gb", *[f"workload.{k}={v}" for k, v in TINY.items()],
                          *overrides)


def test_a_cp_job_predicts_each_role_and_names_the_worst(tmp_path):
    result = predict(_cfg(tmp_path / "cache", "workload.parallelism.cp=2"), tmp_path / "out")
    assert result.num_distinct_traces == 2 and result.ranks_per_trace == {"0": 2, "1": 2}
    mesh = result.mesh
    assert mesh["description"] == "dp_shard 2 x cp 2"
    assert mesh["ranks_per_role"] == {"cp rank 0": 2, "cp rank 1": 2}
    assert mesh["worst_rank_role"] == f"cp rank {result.rank}"
    table = prediction_table(result.to_dict())
    assert "mesh dp_shard 2 x cp 2 on 4 x h100_80gb" in table
    assert f"| worst rank | rank {result.rank} (cp rank {result.rank}, 2 rank(s) alike) |" \
        in table
    # each role's figures and timeline, the worst first
    roles = result.per_role
    assert list(roles) == [mesh["worst_rank_role"], f"cp rank {1 - result.rank}"]
    assert roles[mesh["worst_rank_role"]]["predicted_reserved_peak_bytes"] == \
        result.predicted_reserved_peak_bytes
    assert "| reserved peak*: cp rank 1 |" in table
    for figures in roles.values():
        lines = (tmp_path / "out" / figures["timeline"]).read_text().splitlines()
        assert lines[0] == "op_index,held_bytes,high_bytes,low_bytes" and len(lines) > 100
        assert max(int(line.split(",")[2]) for line in lines[1:]) <= \
            figures["accounted_peak_bytes"]
    assert (tmp_path / "out" / result.memory_timelines).stat().st_size > 0


def test_a_one_dim_job_names_no_mesh(tmp_path):
    result = predict(_cfg(tmp_path))
    assert result.mesh is None and result.ranks_per_trace == {"0": 4}
    assert "worst rank" not in prediction_table(result.to_dict())


def test_a_mesh_that_cannot_split_is_refused_before_capturing(tmp_path):
    with pytest.raises(ConfigError, match=r"n_heads=4 and n_kv_heads=2 must be divisible by tp=4"):
        predict(_cfg(tmp_path, "workload.parallelism.tp=4", "world_size=8"))
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("preset, world, mesh", [
    ("llama3_70b_tp8", 64, "dp_shard 8 x tp 8"),
    ("llama3_405b_tp8", 128, "dp_shard 16 x tp 8"),
    ("llama3_405b_tp8_pp8", 512, "pp 8 x dp_shard 8 x tp 8"),
    ("llama3_8b_cp2", 8, "dp_shard 4 x cp 2"),
    ("qwen3_30b_a3b", 8, "dp_shard 8 x ep 2"),
    ("qwen3_32b", 8, "dp_shard 8"),
    ("qwen3_1_7b", 8, "dp_shard 8"),
    ("deepseek_v3_16b", 8, "dp_shard 8"),
    ("deepseek_v3_671b", 256, "dp_shard 256"),
    ("llama4_scout", 64, "dp_shard 8 x tp 8"),
    ("llama4_maverick", 256, "pp 4 x dp_shard 8 x tp 8"),
])
def test_reference_run_presets_compose_and_validate(preset, world, mesh):
    cfg = predict_config(f"workload={preset}", f"world_size={world}", "target=h100_96gb")
    cfg.validate()
    assert cfg.workload.parallelism.describe(world) == mesh


def test_a_skewed_moe_job_names_its_hot_expert_rank_the_worst(tmp_path):
    """Expert parallel with a hot expert (moe_routing_skew): the ep rank holding it receives
    the most tokens and is the worst rank; the table names the mesh with ep."""
    result = predict(_cfg(tmp_path, "workload.moe_experts=4", "workload.parallelism.ep=2",
                          "workload.moe_routing_skew=1.0"))
    mesh = result.mesh
    assert mesh["description"] == "dp_shard 4 x ep 2"
    assert mesh["ranks_per_role"] == {"ep rank 0": 2, "ep rank 1": 2}
    assert mesh["worst_rank_role"] == "ep rank 0" and result.num_distinct_traces == 2
    hot, cold = (result.per_role[f"ep rank {e}"] for e in (0, 1))
    assert hot["accounted_peak_bytes"] > cold["accounted_peak_bytes"]
