"""Ranks with identical traces: grouped by inode then content, reduced once, replayed once in
compute mode (and every time in full mode)."""
from __future__ import annotations

import os
import shutil
import tarfile

import orjson
import pandas as pd
import pytest

from actors import hardlink
from actors.replay.config import AllocationConfig, ReplayConfig
from actors.trace.source import discover
from orchestrator.preflight import trace_identity, validate
from orchestrator.config import ClusterConfig, ExperimentConfig, RunConfig, TraceConfig
from orchestrator.preflight.dedup import expand_reports
from orchestrator.run.launch import run_replay
from orchestrator.run.sinks import file_sinks
from tests.support.trace_factory import capture_ranks
from tests.support.bounds import CLUSTER_START_S


@pytest.fixture(scope="module")
def mixed4(tmp_path_factory):
    """4 ranks of a real gloo step: 0 and 2 hard links of one file, 1 a byte-identical copy
    of it, 3 its own (different) trace."""
    out = capture_ranks(tmp_path_factory.mktemp("mixed4"), 4)
    zero, one, two = (out / f"rank-{r}.et.json" for r in (0, 1, 2))
    two.unlink()
    os.link(zero, two)
    one.unlink()
    shutil.copyfile(zero, one)
    assert (out / "rank-3.et.json").read_bytes() != zero.read_bytes()
    return out


def _counting_digest(monkeypatch):
    calls = []
    real = trace_identity._digest

    def digest(src, limit):
        calls.append((os.path.basename(src.path), limit))
        return real(src, limit)
    monkeypatch.setattr(trace_identity, "_digest", digest)
    return calls


def test_groups_by_inode_then_content(tmp_path, monkeypatch):
    body = b"x" * (trace_identity.HEAD_BYTES + 10)
    (tmp_path / "rank-0.json").write_bytes(body)
    for r in (1, 2):
        os.link(tmp_path / "rank-0.json", tmp_path / f"rank-{r}.json")
    (tmp_path / "rank-3.json").write_bytes(body)  # a copy: same bytes, another inode
    (tmp_path / "rank-4.json").write_bytes(body[:-1] + b"y")  # differs after the head only
    (tmp_path / "rank-5.json").write_bytes(b"short")  # another size
    calls = _counting_digest(monkeypatch)
    groups = trace_identity.identical_groups(discover(tmp_path))
    assert groups == {0: [0, 1, 2, 3], 4: [4], 5: [5]}
    # one read per inode; a full read only where size and head collide; links never read
    head, full = trace_identity.HEAD_BYTES, None
    assert sorted(calls, key=str) == sorted([
        ("rank-0.json", head), ("rank-3.json", head), ("rank-4.json", head),
        ("rank-5.json", head), ("rank-0.json", full), ("rank-3.json", full),
        ("rank-4.json", full)], key=str)
    assert trace_identity.representatives(groups)[2] == 0


def test_an_unreadable_trace_names_the_file(tmp_path):
    (tmp_path / "rank-0.json").write_bytes(b"{}")
    os.symlink(tmp_path / "gone.json", tmp_path / "rank-1.json")  # dangling: stat fails
    with pytest.raises(Exception, match="rank-1.json.*cannot read file"):
        trace_identity.identical_groups(
            {0: discover(tmp_path / "rank-0.json")[0],
             1: trace_identity.TraceSource(str(tmp_path / "rank-1.json"))})


def test_preflight_reduces_each_distinct_trace_once(mixed4, monkeypatch):
    reduced = []
    real = validate.collect

    def collect(sources, *args):
        reduced.append(sorted(sources))
        return real(sources, *args)
    monkeypatch.setattr(validate, "collect", collect)
    res = validate.preflight(mixed4, mode="compute", executor="inline")
    assert reduced == [[0, 3]]
    assert res.same_as == [0, 0, 0, 3] and res.num_distinct_traces == 2
    assert res.to_dict()["num_distinct_traces"] == 2
    # every rank's signature names its own file in messages: the full mode checks still pass
    full = validate.preflight(mixed4, mode="full", executor="inline")
    assert full.same_as == [0, 0, 0, 3] and full.world_size == 4


def test_expand_reports_shares_the_representatives_report():
    reports = [{"rank": 0, "status": "ok", "peak": 5}, {"rank": 3, "status": "oom", "peak": 9}]
    rows = expand_reports(reports, [0, 3], [0, 0, 0, 3])
    assert [(r["rank"], r["replayed_as_rank"], r["status"]) for r in rows] == \
        [(0, 0, "ok"), (1, 0, "ok"), (2, 0, "ok"), (3, 3, "oom")]
    assert reports[0]["rank"] == 0 and "replayed_as_rank" not in reports[0]  # not mutated


def test_copies_are_hard_links(tmp_path, monkeypatch):
    src, dst = tmp_path / "rank-0.json", tmp_path / "rank-1.json"
    src.write_bytes(b"trace")
    dst.write_bytes(b"an older capture")
    hardlink.link_or_copy(str(src), str(dst))
    assert os.stat(dst).st_ino == os.stat(src).st_ino
    other = tmp_path / "rank-2.json"

    def refuse(*_):
        raise OSError(18, "Invalid cross-device link")
    monkeypatch.setattr(os, "link", refuse)
    hardlink.link_or_copy(str(src), str(other))  # the fallback: a copy
    assert other.read_bytes() == b"trace" and os.stat(other).st_ino != os.stat(src).st_ino


def _cfg(trace_dir, mode):
    return RunConfig(cluster=ClusterConfig(timeout_s=CLUSTER_START_S), trace=TraceConfig(dir=str(trace_dir)),
                     replay=ReplayConfig(mode=mode, iters=2, collective_timeout_s=20,
                                         allocation=AllocationConfig(mode="lazy")),
                     experiment=ExperimentConfig(replay_timeout_s=120, failure_grace_s=3))


@pytest.mark.slow
def test_compute_mode_replays_each_distinct_trace_once(ray_session, mixed4, tmp_path):
    summary = run_replay(_cfg(mixed4, "compute"), tmp_path, sinks=file_sinks())
    assert summary["status"] == "ok", summary["error"]
    assert summary["num_replays"] == 2 and summary["world_size"] == 4
    rows = summary["ranks"]
    assert [(r["rank"], r["replayed_as_rank"]) for r in rows] == [(0, 0), (1, 0), (2, 0), (3, 3)]
    # a copied row is its representative's measurement, not another run
    assert rows[1]["iteration_times_s"] == rows[0]["iteration_times_s"] == \
        rows[2]["iteration_times_s"]
    on_disk = orjson.loads((tmp_path / "summary.json").read_bytes())
    assert [r["replayed_as_rank"] for r in on_disk["ranks"]] == [0, 0, 0, 3]
    csv = pd.read_csv(tmp_path / "ranks.csv")
    assert list(csv["rank"]) == [0, 1, 2, 3] and list(csv["replayed_as_rank"]) == [0, 0, 0, 3]
    assert all((tmp_path / "memory" / f"rank-{r}.csv").is_file() for r in range(4))


@pytest.mark.slow
def test_full_mode_replays_every_rank(ray_session, mixed4, tmp_path):
    summary = run_replay(_cfg(mixed4, "full"), tmp_path, sinks=file_sinks())
    assert summary["status"] == "ok", summary["error"]
    assert summary["num_replays"] == 4
    assert [r["rank"] for r in summary["ranks"]] == [0, 1, 2, 3]
    assert all("replayed_as_rank" not in r for r in summary["ranks"])
    # every rank ran the all-reduces on the process group: none was skipped as a copy
    assert summary["collectives"]["all_reduce"]["num_ranks"] == 4


def test_archive_members_are_grouped_by_content(tmp_path):
    for r, body in ((0, b"same"), (1, b"same"), (2, b"other")):
        (tmp_path / f"rank-{r}.json").write_bytes(body)
    archive = tmp_path / "traces.tar"
    with tarfile.open(archive, "w") as tar:
        for r in range(3):
            tar.add(tmp_path / f"rank-{r}.json", arcname=f"rank-{r}.json")
    assert trace_identity.identical_groups(discover(archive)) == {0: [0, 1], 2: [2]}
