"""Multi-rank archives, the rank-from-name rule and bounded decompression (actors.trace.archive,
actors.trace.source): gzip bombs and oversized members are refused with the limit named."""
from __future__ import annotations

import gzip
import io
import os
import pickle
import tarfile

import pytest

from actors.errors import ConfigError, TraceError
from actors.trace import load_trace
from actors.trace.archive import rank_from_name
from actors.trace.source import TraceSource, discover
from orchestrator.config import TraceConfig
from tests.support.et_json import RELU, node, tensor, write_trace

MIB = 1 << 20


@pytest.mark.parametrize("name,rank", [
    ("rank-3.et.json.gz", 3), ("rank3.json", 3), ("dlrm_eg_3.json", 3), ("foo_rank_3.json", 3),
    ("trace.3.json", 3), ("dlrm_pytorch_et/dlrm_eg_12.json", 12), ("rank-0.json.gz", 0),
    ("resnet_et.json.gz", None), ("gpt2.json", None), ("model_v2.json", None),
    ("rank-3.json.tar.gz", None), ("rank-x.json", None),
])
def test_rank_from_name(name, rank):
    assert rank_from_name(name) == rank


def _trace_bytes(tmp_path, k: int) -> bytes:
    """A one-op trace whose relu reads tensor ``k`` (tells the ranks apart after loading)."""
    op = node(3, "aten::relu", inputs=[tensor(k, k, 4)], outputs=[tensor(k + 1, k + 1, 4)], schema=RELU)
    return write_trace(tmp_path, [op], name=f"src-{k}.json").read_bytes()


def _tar(path, members: dict[str, bytes], mode="w:gz"):
    with tarfile.open(path, mode) as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


@pytest.mark.parametrize("mode", ["w", "w:gz"])
def test_archive_of_rank_files(tmp_path, mode):
    """Members in a folder, plain and gzip; a non-trace member is ignored."""
    members = {"job/rank-0.et.json": _trace_bytes(tmp_path, 10),
               "job/rank-1.et.json.gz": gzip.compress(_trace_bytes(tmp_path, 20)),
               "job/README.txt": b"not a trace"}
    archive = _tar(tmp_path / "job.tar", members, mode)
    sources = discover(archive)
    assert {r: s.member for r, s in sources.items()} == {0: "job/rank-0.et.json",
                                                        1: "job/rank-1.et.json.gz"}
    for rank, source in sources.items():
        # path transfer: the actor reads its member; object_store: it gets the member's bytes
        shipped = pickle.loads(pickle.dumps((source, source.read_raw())))
        for trace in (load_trace(source), load_trace(*shipped[:1], data=shipped[1])):
            assert trace.rank == rank and trace.ops[0].inputs[0].tensor_id == 10 * (rank + 1)
            assert trace.path == f"{archive}:{source.member}"


def test_member_without_a_rank_is_refused_unless_alone(tmp_path):
    data = _trace_bytes(tmp_path, 10)
    two = _tar(tmp_path / "two.tar.gz", {"rank-0.json": data, "model.json": data})
    with pytest.raises(TraceError, match=r"two.tar.gz:model.json: the member's name carries no rank, "
                                         r"and the archive holds 2 traces"):
        discover(two)
    one = _tar(tmp_path / "one.tar.gz", {"model.json": data})
    (source,) = discover(one).values()
    assert discover(one) == {0: source} and load_trace(source).num_nodes == 3
    assert load_trace(one).num_nodes == 3  # a one-trace archive also loads as a file


def test_duplicate_ranks_and_empty_archives_are_refused(tmp_path):
    data = _trace_bytes(tmp_path, 10)
    with pytest.raises(ConfigError, match="rank 1 has two trace files, a/rank-1.json and b/rank_1.json"):
        discover(_tar(tmp_path / "dup.tar", {"a/rank-1.json": data, "b/rank_1.json": data}, "w"))
    with pytest.raises(ConfigError, match=r"holds no \*.json or \*.json.gz member"):
        discover(_tar(tmp_path / "none.tar", {"notes.txt": b"x"}, "w"))


def test_one_trace_file_is_rank_zero_unless_named(tmp_path):
    plain = write_trace(tmp_path, [], name="model.json")
    assert list(discover(plain)) == [0]
    named = write_trace(tmp_path, [], name="job_rank_5.json")
    assert list(discover(named)) == [5]


# ---------------------------------------------------------------- bounded decompression

def _bomb(num_bytes: int) -> bytes:
    """gzip of ``num_bytes`` of spaces (valid JSON padding): ~1000x smaller on disk."""
    return gzip.compress(b'{"schema": "1.1.1", "nodes": []' + b" " * num_bytes + b"}")


def test_gzip_bomb_is_refused_past_the_limit(tmp_path):
    path = tmp_path / "rank-0.json.gz"
    path.write_bytes(_bomb(64 * MIB))
    assert path.stat().st_size < MIB // 4
    source = TraceSource(str(path), None, 4 * MIB)
    with pytest.raises(TraceError, match=r"rank-0.json.gz: expands past the limit of 4,194,304 bytes; "
                                         r"if the trace is genuine, raise the limit: "
                                         r"trace.max_decompressed_bytes=16GiB") as err:
        load_trace(source)
    assert err.value.path == str(path)
    # within the limit, the same file is read (an empty trace: the limit was the only problem)
    assert load_trace(TraceSource(str(path), None, 128 * MIB)).ops == []


def test_plain_file_past_the_limit_is_refused_before_parsing(tmp_path):
    path = tmp_path / "rank-0.json"
    path.write_bytes(b'{"schema": "1.1.1", "nodes": []' + b" " * (2 * MIB) + b"}")
    with pytest.raises(TraceError, match=r"rank-0.json: expands past the limit of 1,048,576"):
        load_trace(TraceSource(str(path), None, MIB))
    assert load_trace(TraceSource(str(path), None, 4 * MIB)).ops == []


def test_oversized_member_is_refused_from_its_header(tmp_path):
    archive = _tar(tmp_path / "job.tar.gz", {"rank-0.json": _trace_bytes(tmp_path, 10),
                                             "rank-1.json": b" " * (2 * MIB)})
    with pytest.raises(TraceError, match=r"job.tar.gz:rank-1.json: expands past the limit of 1,048,576"):
        discover(archive, max_decompressed_bytes=MIB)
    sources = discover(archive)  # the default limit admits both
    small = TraceSource(sources[1].path, sources[1].member, MIB)
    with pytest.raises(TraceError, match="expands past the limit"):
        small.read_raw()


def test_gzip_bomb_inside_an_archive_is_refused(tmp_path):
    archive = _tar(tmp_path / "job.tar", {"rank-0.json.gz": _bomb(64 * MIB)}, "w")
    (source,) = discover(archive, max_decompressed_bytes=4 * MIB).values()
    with pytest.raises(TraceError, match=r"job.tar:rank-0.json.gz: expands past the limit of 4,194,304"):
        load_trace(source)


def test_truncated_archive_is_a_trace_error(tmp_path):
    whole = _tar(tmp_path / "job.tar.gz", {"rank-0.json": _trace_bytes(tmp_path, 10),
                                           "rank-1.json": _trace_bytes(tmp_path, 20)}).read_bytes()
    cut = tmp_path / "cut.tar.gz"
    cut.write_bytes(whole[:len(whole) // 2])
    with pytest.raises(TraceError, match="cut.tar.gz.*truncated or corrupt"):
        discover(cut)


def test_limit_setting_parses_sizes_and_refuses_nonsense():
    assert TraceConfig(max_decompressed_bytes="16GiB").decompression_limit_bytes() == 16 << 30
    assert TraceConfig(max_decompressed_bytes="1000").decompression_limit_bytes() == 1000
    for bad in ("lots", "0"):
        with pytest.raises(ConfigError, match="trace.max_decompressed_bytes"):
            TraceConfig(max_decompressed_bytes=bad)


def test_source_is_a_path_for_the_filesystem(tmp_path):
    archive = _tar(tmp_path / "job.tar", {"rank-0.json": _trace_bytes(tmp_path, 10)}, "w")
    source = discover(archive)[0]
    assert os.stat(source).st_size == archive.stat().st_size  # actors key caches on it
    assert str(source) == f"{archive}:rank-0.json" and source.name == "rank-0.json"
