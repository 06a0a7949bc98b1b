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


_BOMB_SCRIPT = """
import sys
from actors.errors import TraceError
from actors.trace import archive, load_trace
from actors.trace.source import TraceSource
path, limit = sys.argv[1], int(sys.argv[2])
try:
    load_trace(TraceSource(path, None, limit))
except TraceError as e:
    print(e)
# VmHWM, not ru_maxrss: this process's own peak (ru_maxrss keeps the forking parent's)
print(next(line for line in open("/proc/self/status") if line.startswith("VmHWM")))
"""


def test_a_gzip_bomb_is_refused_at_its_bound_without_holding_it(tmp_path):
    """1 GiB of zeros named like a rank trace, refused at a 768 MiB bound: the stream is only
    counted past 256 MiB (archive.HOLD_BYTES), so the reader's peak stays far below the bound
    (it held the whole bound before). A gzip file given alone is read as gzip, not as the
    empty tar its zeros look like."""
    import subprocess
    import sys

    bomb = tmp_path / "rank-0.et.json.gz"
    packer, zeros = gzip.zlib.compressobj(1, gzip.zlib.DEFLATED, 31), bytes(64 * MIB)
    with open(bomb, "wb") as f:
        for _ in range(16):
            f.write(packer.compress(zeros))
        f.write(packer.flush())
    assert discover(bomb) == {0: TraceSource(str(bomb))}  # one trace, not an archive
    limit = 768 * MIB
    proc = subprocess.run([sys.executable, "-c", _BOMB_SCRIPT, str(bomb), str(limit)],
                          capture_output=True, text=True, timeout=240,
                          env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert proc.returncode == 0, proc.stderr
    message, peak = proc.stdout.strip().splitlines()
    assert message == (f"{bomb}: expands past the limit of {limit:,} bytes; if the trace is "
                       "genuine, raise the limit: trace.max_decompressed_bytes=16GiB (tracefleet) "
                       "or --max-decompressed-bytes 16GiB (tracefleet-inspect)")
    peak_bytes = int(peak.split()[1]) * 1024  # "VmHWM:  123 kB"
    assert peak_bytes < limit / 2, f"peak RSS {peak_bytes / MIB:.0f} MiB"


def test_a_stream_longer_than_what_is_held_is_inflated_again(tmp_path, monkeypatch):
    from actors.trace import archive

    data = os.urandom(3 * MIB) + b"x" * (5 * MIB)
    packed = gzip.compress(data[:4 * MIB]) + gzip.compress(data[4 * MIB:]) + b"\0" * 8
    monkeypatch.setattr(archive, "HOLD_BYTES", MIB)
    assert archive.gunzip(packed, 64 * MIB, "w") == data  # two members and NUL padding
    with pytest.raises(TraceError, match="expands past the limit of 7,340,032 bytes"):
        archive.gunzip(packed, 7 * MIB, "w")
    with pytest.raises(TraceError, match="trailing garbage after the last gzip member"):
        archive.gunzip(packed + b"junk", 64 * MIB, "w")
    with pytest.raises(TraceError, match="the data ends inside a gzip member"):
        archive.gunzip(packed[:MIB], 64 * MIB, "w")


def test_a_plain_file_past_the_bound_is_refused_unread(tmp_path, monkeypatch):
    from actors.trace import archive

    big = tmp_path / "rank-0.json"
    big.write_bytes(b"{" + b" " * 2048)
    monkeypatch.setattr("builtins.open", _no_read(open))
    with pytest.raises(TraceError, match="expands past the limit of 1,024 bytes"):
        archive.read_file(big, 1024)


def _no_read(real_open):
    """``open`` whose files refuse ``read``: what is refused from its size reads nothing."""
    def opener(*args, **kwargs):
        f = real_open(*args, **kwargs)

        class NoRead:
            def __enter__(self):
                return self

            def __exit__(self, *exc):
                f.close()

            def fileno(self):
                return f.fileno()

            def read(self, *a):
                raise AssertionError("read() called on a file past the bound")
        return NoRead()
    return opener
