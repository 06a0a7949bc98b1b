"""A mesh job's roles recorded at once (orchestrator/run/roles.py): in local worker processes
the same traces as one after another, each role measured and bounded where it runs
(on a two-node Ray cluster: tests/orchestrator/cluster/test_ray_pool.py)."""
from __future__ import annotations

import logging

import pytest
from hydra.errors import ConfigCompositionException

from actors.capture.workloads.config import WorkloadConfig
from actors.errors import ConfigError
from actors.memory_limit import MemoryLimitError
from actors.trace import load_trace
from actors.trace.conventions import trace_file_name
from orchestrator.run.capture import CaptureConfig, run_capture_job
from orchestrator.run.roles_config import RolesConfig

pytestmark = pytest.mark.slow

# pp 2 x dp 2 at world 4: two roles (the stages), each recorded once, its dp peer derived
TINY = dict(model="llama", parallel="fsdp2", precision="bf16_mixed", device="fake", vocab=64,
            d_model=64, n_layers=2, n_heads=4, seq_len=32, batch_size=2,
            parallelism={"pp": 2})
WORLD_SIZE = 4


def _capture(out_dir, roles: RolesConfig) -> dict:
    return run_capture_job(CaptureConfig(workload=WorkloadConfig(**TINY), world_size=WORLD_SIZE,
                                         out_dir=str(out_dir), roles=roles)).meta


def _ops(out_dir) -> list[list[str]]:
    return [[op.name for op in load_trace(out_dir / trace_file_name(rank)).ops]
            for rank in range(WORLD_SIZE)]


@pytest.fixture(scope="module")
def in_order(tmp_path_factory):
    out = tmp_path_factory.mktemp("in_order")
    return out, _capture(out, RolesConfig(num_workers=1))


def test_roles_in_workers_record_what_one_after_another_does(in_order, tmp_path, caplog):
    serial_dir, serial_meta = in_order
    caplog.set_level(logging.INFO, logger="tracefleet")
    meta = _capture(tmp_path, RolesConfig(num_workers=2))
    assert _ops(tmp_path) == _ops(serial_dir)
    for m in (serial_meta, meta):
        recordings = m["role_recordings"]
        assert [r["role"] for r in recordings] == list(m["mesh"]["roles"])
        assert len(recordings) == 2 and all(r["peak_rss_bytes"] > 0 for r in recordings)
    # one process recorded both roles one after another; at once, a fresh process per role
    assert len({r["pid"] for r in serial_meta["role_recordings"]}) == 1
    assert len({r["pid"] for r in meta["role_recordings"]}) == 2
    assert [m["rank"] for m in meta["ranks"]] == list(range(WORLD_SIZE))
    assert sum("recorded in" in r.message for r in caplog.records) == 2


def test_auto_sizes_the_rest_by_the_first_role(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="tracefleet")
    meta = _capture(tmp_path, RolesConfig(num_workers=0))
    assert len(meta["role_recordings"]) == 2
    sized = [r.message for r in caplog.records if "at once" in r.message]
    assert len(sized) == 1 and sized[0].startswith("capture: 1 role(s) left, 1 at once")


@pytest.mark.parametrize("num_workers", [1, 2])
def test_a_role_past_its_memory_bound_is_stopped_by_name(tmp_path, num_workers):
    # any process holding torch is past 0.05 GiB resident: the first tick stops the recording
    with pytest.raises(MemoryLimitError, match=r"roles\.memory_limit_gib=0\.05 GiB: the fake "
                       r"capture's recording of rank 0 \(role pp stage 0\) held [\d.]+ GiB"):
        _capture(tmp_path, RolesConfig(num_workers=num_workers, memory_limit_gib=0.05))
    assert not list(tmp_path.glob("rank-*"))  # nothing a rerun would refuse


@pytest.mark.parametrize("roles, match", [
    (RolesConfig(num_workers=-1), r"roles\.num_workers=-1"),
    (RolesConfig(memory_limit_gib=float("nan")), r"roles\.memory_limit_gib=nan"),
    (RolesConfig(num_workers=0, executor="ray"), r"roles\.executor=ray with roles\.num_workers=0"),
])
def test_roles_settings_no_executor_can_honour_are_refused(tmp_path, roles, match):
    with pytest.raises(ConfigError, match=match):
        _capture(tmp_path, roles)


def test_predict_composes_its_roles_settings_and_refuses_a_typo():
    # predict.roles.num_workers=2 predicts what 1 does: scripts/bench_roles.py (and its smoke test)
    from orchestrator.cli.predict import predict_config

    cfg = predict_config("workload=llama3_8b", "predict.roles.num_workers=2",
                         "predict.roles.memory_limit_gib=12")
    assert (cfg.predict.roles.num_workers, cfg.predict.roles.memory_limit_gib) == (2, 12)
    with pytest.raises(ConfigCompositionException, match="predict.roles.executor=everywhere"):
        predict_config("workload=llama3_8b", "predict.roles.executor=everywhere")
