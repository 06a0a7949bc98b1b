"""A loaded trace kept on disk (actors/trace/parsed_cache.py): the next load of the same file
reads back the same objects without parsing; an edited file, another rank, a file that is not
ours or is cut are misses; small traces are never written; the folder stays under its size."""
from __future__ import annotations

import logging
import os
from dataclasses import replace

import pytest

from actors.trace import load_trace, loader, parsed_cache
from actors.trace.source import as_source, discover
from orchestrator.config import DEMO_TRACES
from tests.support.trace_state import trace_state

RANK0 = DEMO_TRACES / "gpt_dp_4" / "rank-0.et.json.gz"


@pytest.fixture
def every_size(monkeypatch):
    """Cache traces of any size (the demo's are far below the threshold)."""
    monkeypatch.setattr(parsed_cache, "MIN_CACHED_BYTES", 0)


def _source(path, cache_dir):
    return replace(as_source(path), parsed_cache_dir=str(cache_dir))


def _no_parse(monkeypatch):
    """Fail any load that parses the file (a hit must not)."""
    def parse(*args):
        raise AssertionError("the trace was parsed again")
    monkeypatch.setattr(loader, "_load_trace", parse)


@pytest.mark.parametrize("trace", [RANK0, DEMO_TRACES / "gpt_zero3_2" / "rank-1.et.json.gz"],
                         ids=lambda p: p.parent.name)
def test_the_second_load_reads_back_the_same_trace(trace, tmp_path, every_size, monkeypatch):
    source = _source(trace, tmp_path / "cache")
    first = load_trace(source)
    assert len(list((tmp_path / "cache").glob("*.json"))) == 1
    _no_parse(monkeypatch)
    again = load_trace(source)
    assert trace_state(again) == trace_state(first)
    assert trace_state(again) == trace_state(load_trace(_source(trace, tmp_path / "cache")))


def test_an_edited_file_or_another_rank_is_a_miss(tmp_path, every_size):
    path = tmp_path / "rank-0.et.json.gz"
    path.write_bytes(RANK0.read_bytes())
    source = _source(path, tmp_path / "cache")
    load_trace(source)
    load_trace(source, rank=5)  # the rank is part of what was loaded
    os.utime(path, ns=(1, 1))  # the same bytes, touched: it may have been rewritten
    assert load_trace(source).rank == 0
    assert len(list((tmp_path / "cache").glob("*.json"))) == 3


def test_a_broken_or_foreign_cache_file_is_loaded_again(tmp_path, every_size, caplog):
    source = _source(RANK0, tmp_path / "cache")
    expected = trace_state(load_trace(source))
    (cached,) = (tmp_path / "cache").glob("*.json")
    good = cached.read_bytes()
    for broken in (good[:len(good) // 2], b"not ours\n" + good, good.replace(b'"o"', b'"x"', 1)):
        cached.write_bytes(broken)
        with caplog.at_level(logging.WARNING, logger=parsed_cache.__name__):
            assert trace_state(load_trace(source)) == expected
        assert cached.read_bytes() == good  # written again by the load


def test_small_traces_are_not_written(tmp_path):
    load_trace(_source(RANK0, tmp_path / "cache"))
    assert not (tmp_path / "cache").exists()


def test_discover_hands_the_folder_to_every_source(tmp_path):
    sources = discover(DEMO_TRACES / "gpt_dp_4", parsed_cache_dir=str(tmp_path))
    assert {s.parsed_cache_dir for s in sources.values()} == {str(tmp_path)}
    assert {s.parsed_cache_dir for s in discover(DEMO_TRACES / "gpt_dp_4").values()} == {None}


def test_the_folder_keeps_under_its_size_least_recent_first(tmp_path, every_size, monkeypatch):
    cache = tmp_path / "cache"
    paths = []
    for i in range(3):
        paths.append(tmp_path / f"rank-{i}.et.json.gz")
        paths[-1].write_bytes(RANK0.read_bytes())
    load_trace(_source(paths[0], cache))
    size = next(cache.glob("*.json")).stat().st_size
    monkeypatch.setattr(parsed_cache, "MAX_CACHE_BYTES", int(size * 2.5))
    load_trace(_source(paths[1], cache))
    first_key = parsed_cache._key(_source(paths[0], cache), None)
    os.utime(cache / f"{first_key}.json", (1, 1))  # the least recently used
    load_trace(_source(paths[2], cache))
    names = {p.stem for p in cache.glob("*.json")}
    assert len(names) == 2 and first_key not in names


def test_a_value_the_format_cannot_hold_is_not_written(tmp_path, every_size, monkeypatch):
    real = loader._load_trace

    def with_a_set(*args):
        trace = real(*args)
        trace.meta["odd"] = {1, 2}  # a set: not one of the model's types
        return trace
    monkeypatch.setattr(loader, "_load_trace", with_a_set)
    assert load_trace(_source(RANK0, tmp_path / "cache")).meta["odd"] == {1, 2}
    assert not list((tmp_path / "cache").glob("*.json"))
