"""The capture's trace files written a node at a time (actors/capture/trace_file.py) hold what
the whole document's rewrite and dump wrote, byte for byte once inflated: the observer's file
of a tensor-parallel fake step after the fake mode's rewrites (DTensor frames marked, the mode's
nodes dropped, c10d groups named), and a role's other rank derived from its recorded one; a
recorded table the caller refuses writes no other rank."""
from __future__ import annotations

import gzip
import shutil

import orjson
import pytest

from actors.capture import recorder
from actors.capture.fake.group_names import group_table, rank_renamer
from actors.capture.trace_file import rewrite_file, write_as_ranks
from actors.capture.workloads.config import WorkloadConfig
from actors.errors import TracefleetError
from actors.trace.conventions import trace_file_name
from actors.trace.node_stream import read_json
from orchestrator.run.capture import CaptureConfig, run_capture_job

TINY = dict(model="llama", parallel="fsdp2", precision="bf16_mixed", device="fake", vocab=64,
            d_model=64, n_layers=2, n_heads=4, seq_len=32, batch_size=2)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """A tp=2 x dp_shard=2 fake capture, each rewrite's observer file and rewrite kept."""
    out = tmp_path_factory.mktemp("tp")
    kept = []

    def keep(raw_path, out_path, rewrite):
        copy = out / f"observer-{len(kept)}.json"
        shutil.copy(raw_path, copy)
        kept.append((copy, out_path, rewrite))
        rewrite_file(raw_path, out_path, rewrite)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(recorder, "rewrite_file", keep)
        cfg = CaptureConfig(workload=WorkloadConfig(**TINY, parallelism={"tp": 2}),
                            world_size=4, out_dir=str(out / "traces"))
        run_capture_job(cfg)
    return out / "traces", kept


def test_the_rewritten_file_is_the_whole_documents_rewrite(recorded):
    _, kept = recorded
    assert kept, "the fake capture rewrote no observer file"
    for observer, out_path, rewrite in kept:
        doc = orjson.loads(observer.read_bytes())
        num_nodes = len(doc["nodes"])
        rewrite(doc)  # what the capture did before: the whole document, edited in place
        names = {n["name"] for n in doc["nodes"]}
        assert len(doc["nodes"]) < num_nodes and "PythonSubclass" in names  # it edited
        with gzip.open(out_path, "rb") as f:
            assert f.read() == orjson.dumps(doc)


def test_small_chunks_write_the_same_file(recorded, tmp_path, monkeypatch):
    """The nodes' compact text is read back a chunk at a time: nodes that straddle chunks, and
    flushes between any two nodes, write the same bytes."""
    from actors.capture import trace_file
    _, kept = recorded
    monkeypatch.setattr(trace_file, "_WRITE_BYTES", 97)
    for i, (observer, out_path, rewrite) in enumerate(kept):
        raw = tmp_path / f"observer-{i}.json"
        shutil.copy(observer, raw)
        again = tmp_path / f"again-{i}.json.gz"
        rewrite_file(str(raw), str(again), rewrite)
        assert not raw.exists() and not (tmp_path / f"again-{i}.json.gz.nodes").exists()
        with gzip.open(again, "rb") as a, gzip.open(out_path, "rb") as b:
            assert a.read() == b.read()


def test_a_derived_rank_is_its_roles_trace_renamed(recorded):
    traces, _ = recorded
    first = read_json(traces / trace_file_name(0))
    derived = read_json(traces / trace_file_name(1))
    rename = rank_renamer(group_table(first["nodes"]), group_table(derived["nodes"]), "test")
    expected = {**first, "nodes": [rename(n) for n in first["nodes"]]}
    assert group_table(derived["nodes"]) != group_table(first["nodes"])
    with gzip.open(traces / trace_file_name(1), "rb") as f:
        assert f.read() == orjson.dumps(expected)


def test_a_refused_table_writes_no_rank(recorded, tmp_path):
    traces, _ = recorded
    first = traces / trace_file_name(0)
    table = group_table(read_json(first)["nodes"])
    seen = []

    def refuse(found):
        seen.append(found)
        raise TracefleetError("not this mesh's groups")
    target = tmp_path / trace_file_name(1)
    with pytest.raises(TracefleetError, match="not this mesh's groups"):
        write_as_ranks(str(first), refuse, {str(target): (table, "rank 1")})
    assert seen == [table] and not target.exists()
