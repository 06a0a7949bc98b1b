"""Benchmark: ``json.load`` of a large trace vs ``actors.trace.load_trace`` (full model build).

Builds a LARGE trace by concatenating the nodes of the public GPT-2 trace (ids remapped per
copy, so each copy is one more ProfilerStep) up to ``--nodes`` nodes, writes it as plain
``.json`` into a temp dir, then times, alternately and ``--reps`` times each, in a fresh
subprocess per measurement (so peak RSS is that reader's own):

* ``json.load(open(path))`` - how the reference replayer reads a trace;
* ``load_trace(path)``      - our reader: parse, select ops, typed args, ids, collectives;
* ``json.load`` again with the cyclic GC off, as load_trace runs: the pure parse cost;
* with ``--gc-ab``, also ``load_trace`` with the cyclic GC left on (``load_trace_gc_on``):
  what disabling it during the load buys.

Prints ONE JSON line: nodes, file size, best-of-reps seconds of each, their ratio
(load_trace / json.load; target <= 1.0) and each reader's peak RSS. ``--profile`` also
prints the loader's top functions (cProfile, in this process) to stderr.

``--large`` also builds a trace of at least ``--large-mb`` MB of JSON (700: a 405B pipeline
stage's size) and loads it, in a fresh process each, as the loader reads it (one node at a
time, actors/trace/node_stream.py) and parsed whole (as it did before): its ``large`` object
holds both loads' seconds and peak RSS, MB/s, and the targets (peak RSS <= 2 GiB, >= 30 MB/s).
It also rewrites the file as the fake capture rewrites the observer's (DTensor frames, the
fake mode's nodes: actors/capture/trace_file.py) and writes it gzipped, a node at a time and as
the whole document (as before): ``rewrite_*`` seconds and peak RSS. And it loads the file with
the parsed-trace cache (actors/trace/parsed_cache.py): the first load, which writes it
(``cache_write_load_s``), and the next, which reads it (``cached_load_s``, its peak RSS).

    python scripts/bench_load.py --nodes 1000000 --reps 3 [--gc-ab] [--large]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from scripts.json_layout import emit  # noqa: E402

DEFAULT_SOURCE = REPO.parent / "shared" / "traces" / "public" / "param" / "hf_GPT2_et.json.tar.gz"
READERS = ("json_load", "load_trace", "json_load_nogc")
# the loader, the loader parsing whole; the capture's rewrite, and the whole document's
# and the first and second load with the parsed-trace cache (in this order)
LARGE_READERS = ("load_trace", "load_trace_whole", "rewrite", "rewrite_whole", "cache_write",
                 "cache_hit")
LARGE_TARGETS = {"peak_rss_gib": 2.0, "mb_per_s": 30.0}
CHILD_TIMEOUT_S = 3600
_MiB = 1 << 20


def layout(gc_ab: bool = False, large: bool = False) -> dict:
    """The keys of the JSON line (scripts/json_layout.py); ``gc_ab``, ``large``: with
    ``--gc-ab``'s, ``--large``'s."""
    readers = READERS + (("load_trace_gc_on",) if gc_ab else ())
    large_keys = {"file_mb": None, "nodes": None, "load_s": None, "mb_per_s": None,
                  "peak_rss_gib": None, "whole_load_s": None, "whole_peak_rss_gib": None,
                  "peak_rss_over_whole": None, "rewrite_s": None, "rewrite_peak_rss_gib": None,
                  "whole_rewrite_s": None, "whole_rewrite_peak_rss_gib": None,
                  "cache_write_load_s": None, "cached_load_s": None, "cached_peak_rss_gib": None,
                  "cached_over_load": None,
                  "targets_met": {k: None for k in LARGE_TARGETS}}
    return {**({"large": large_keys} if large else {}),"nodes": None, "file_mb": None, "reps": None, "json_load_s": None,
            "load_trace_s": None, "ratio": None, "json_load_nogc_s": None, "ratio_vs_nogc": None,
            **({"load_trace_gc_on_s": None, "gc_off_speedup": None} if gc_ab else {}),
            **{f"peak_rss_mb_{r}": None for r in readers},
            "all_s": {r: [None] for r in readers}}


KEYS = layout()  # a full run's (and --quick's) line


def build_large_trace(source: Path, num_nodes: int, out: Path) -> int:
    """Write ``num_nodes`` nodes made of repeated copies of ``source``'s nodes; returns bytes written."""
    import orjson

    from actors.trace import read_json

    doc = read_json(source)
    nodes = sorted(doc["nodes"], key=lambda n: n["id"])
    root, body = nodes[0], nodes[1:]  # the process root (id 1) appears once
    span = body[-1]["id"]
    parent_key = "ctrl_deps" if "ctrl_deps" in root else "parent"
    head = {k: v for k, v in doc.items() if k != "nodes"}
    with open(out, "wb") as f:
        f.write(orjson.dumps(head)[:-1] + b',"nodes":[' + orjson.dumps(root))
        written, copy = 1, 0
        while written < num_nodes:
            offset = copy * span
            # id order keeps every parent before its children, so a cut copy stays consistent
            for n in body[:num_nodes - written]:
                parent = n[parent_key]
                f.write(b"," + orjson.dumps({**n, "id": n["id"] + offset,
                                             parent_key: parent if parent == 1 else parent + offset}))
            written += min(len(body), num_nodes - written)
            copy += 1
        f.write(b"]}")
    return out.stat().st_size


def child(reader: str, path: str) -> None:
    """Run one reader once in this (fresh) process; print seconds and peak RSS as JSON."""
    import resource

    if reader.startswith("rewrite"):
        elapsed_s, count = _rewrite(path, whole=reader == "rewrite_whole")
    elif reader.startswith("cache_"):
        elapsed_s, count = _cached_load(path, first=reader == "cache_write")
    elif reader.startswith("json_load"):
        if reader == "json_load_nogc":
            gc.disable()
        start = time.perf_counter()
        with open(path) as f:
            doc = json.load(f)
        elapsed_s = time.perf_counter() - start
        count = len(doc["nodes"])
    else:
        from actors.trace import load_trace
        from actors.trace.loader import _load_trace  # load_trace minus its gc.disable()
        if reader == "load_trace_whole":  # the loader as it was: the document parsed whole
            from actors.trace import node_stream

            def whole(text):
                raise node_stream.LayoutMismatch
            node_stream._skeleton = whole
        start = time.perf_counter()
        trace = _load_trace(Path(path), None, None) if reader == "load_trace_gc_on" \
            else load_trace(path)
        elapsed_s = time.perf_counter() - start
        count = trace.num_nodes
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    print(json.dumps({"s": elapsed_s, "nodes": count, "peak_rss_mb": peak_kib / 1024}))


def _rewrite(path: str, whole: bool) -> tuple[float, int]:
    """Seconds of the fake capture's rewrite of ``path`` (a copy: the rewrite removes its input)
    into a gzipped file, and the nodes read."""
    import gzip
    import shutil

    import orjson

    from actors.capture.fake.fake_mode import strip_dispatch_mode_nodes
    from actors.capture.fake.subclass_frames import mark_subclass_frames
    from actors.capture.trace_file import rewrite_file
    from actors.gc_pause import gc_paused

    num_nodes = []

    def rewrite(doc):
        num_nodes.append(len(doc["nodes"]))
        mark_subclass_frames(doc)
        strip_dispatch_mode_nodes(doc)

    raw, out = f"{path}.raw", f"{path}.rewritten.gz"
    shutil.copy(path, raw)
    start = time.perf_counter()
    if whole:  # the capture's rewrite as it was: the document parsed, rewritten, dumped
        with gc_paused():
            with open(raw, "rb") as src:
                doc = orjson.loads(src.read())
            rewrite(doc)
            with gzip.open(out, "wb", compresslevel=6) as dst:
                dst.write(orjson.dumps(doc))
            del doc
        os.remove(raw)
    else:
        rewrite_file(raw, out, rewrite)
    elapsed_s = time.perf_counter() - start
    os.remove(out)
    return elapsed_s, num_nodes[0]


def _cached_load(path: str, first: bool) -> tuple[float, int]:
    """Seconds of a load through the parsed-trace cache beside ``path`` (``first``: emptied
    before, so the load parses and writes it), and the trace's nodes."""
    import shutil
    from dataclasses import replace

    from actors.trace import load_trace, parsed_cache
    from actors.trace.source import as_source

    parsed_cache.MIN_CACHED_BYTES = 0  # a quick run's trace is below the size cached
    cache = Path(f"{path}.parsed")
    if first:
        shutil.rmtree(cache, ignore_errors=True)
    elif not any(cache.glob("*.json")):
        raise SystemExit("bench_load: the first load wrote no parsed-trace cache")
    start = time.perf_counter()
    trace = load_trace(replace(as_source(path), parsed_cache_dir=str(cache)))
    elapsed_s = time.perf_counter() - start
    if not first:
        shutil.rmtree(cache)
    return elapsed_s, trace.num_nodes


def measure(reader: str, path: Path) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--child", reader, str(path)], cwd=REPO,
                          capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    if proc.returncode != 0:
        raise SystemExit(f"bench_load: {reader} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def profile(path: Path, top: int = 25) -> None:
    import cProfile
    import pstats

    from actors.trace import load_trace
    prof = cProfile.Profile()
    prof.runcall(load_trace, path)
    pstats.Stats(prof, stream=sys.stderr).sort_stats("tottime").print_stats(top)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=1_000_000, help="nodes in the built trace")
    parser.add_argument("--reps", type=int, default=3, help="measurements per reader")
    parser.add_argument("--source", type=Path, default=DEFAULT_SOURCE, help="trace to replicate")
    parser.add_argument("--workdir", type=Path, default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--profile", action="store_true", help="cProfile load_trace to stderr")
    parser.add_argument("--gc-ab", action="store_true", help="also time load_trace with the GC on")
    parser.add_argument("--large", action="store_true",
                        help="also load a trace of --large-mb MB, streamed and parsed whole")
    parser.add_argument("--large-mb", type=float, default=700.0, help="the large trace's JSON size")
    parser.add_argument("--child", nargs=2, metavar=("READER", "PATH"), help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="smoke run: smallest inputs, seconds (the test suite runs it)")
    args = parser.parse_args(argv)
    if args.quick:
        args.nodes, args.reps, args.large_mb = 20_000, 1, 8.0
    if args.child:
        return child(*args.child)
    if not args.source.is_file():
        raise SystemExit(f"bench_load: source trace {args.source} not found (see shared/traces/public)")
    with tempfile.TemporaryDirectory(prefix="tf-bench-", dir=args.workdir) as tmp:
        path = Path(tmp) / "large.json"
        file_bytes = build_large_trace(args.source, args.nodes, path)
        readers = READERS + (("load_trace_gc_on",) if args.gc_ab else ())
        runs: dict[str, list[dict]] = {r: [] for r in readers}
        for _ in range(args.reps):  # alternate, so machine load hits both alike
            for reader in readers:
                runs[reader].append(measure(reader, path))
        assert all(run["nodes"] == args.nodes for rs in runs.values() for run in rs)
        if args.profile:
            profile(path)
        large = measure_large(args.source, args.large_mb, args.reps, Path(tmp)) if args.large \
            else None
    best = {r: min(run["s"] for run in rs) for r, rs in runs.items()}
    result = {"nodes": args.nodes, "file_mb": round(file_bytes / _MiB, 1), "reps": args.reps,
              "json_load_s": round(best["json_load"], 3), "load_trace_s": round(best["load_trace"], 3),
              "ratio": round(best["load_trace"] / best["json_load"], 3),
              "json_load_nogc_s": round(best["json_load_nogc"], 3),
              "ratio_vs_nogc": round(best["load_trace"] / best["json_load_nogc"], 3)}
    if args.gc_ab:
        result["load_trace_gc_on_s"] = round(best["load_trace_gc_on"], 3)
        result["gc_off_speedup"] = round(best["load_trace_gc_on"] / best["load_trace"], 3)
    for reader, rs in runs.items():
        result[f"peak_rss_mb_{reader}"] = round(max(run["peak_rss_mb"] for run in rs), 1)
    result["all_s"] = {r: [round(run["s"], 3) for run in rs] for r, rs in runs.items()}
    if large is not None:
        result = {"large": large, **result}
    emit(result, layout(args.gc_ab, args.large))


def measure_large(source: Path, file_mb: float, reps: int, tmp: Path) -> dict:
    """Build a trace of at least ``file_mb`` MB and load it ``reps`` times each way."""
    path = tmp / "larger.json"
    sample = tmp / "sample.json"
    per_node = build_large_trace(source, 20_000, sample) / 20_000
    sample.unlink()
    num_nodes = int(file_mb * _MiB / per_node) + 1
    file_bytes = build_large_trace(source, num_nodes, path)
    runs: dict[str, list[dict]] = {r: [] for r in LARGE_READERS}
    for _ in range(reps):  # alternate, so machine load hits both alike
        for reader in LARGE_READERS:
            runs[reader].append(measure(reader, path))
    path.unlink()
    assert all(run["nodes"] == num_nodes for rs in runs.values() for run in rs)
    best_s = {r: min(run["s"] for run in rs) for r, rs in runs.items()}
    peak_gib = {r: max(run["peak_rss_mb"] for run in rs) / 1024 for r, rs in runs.items()}
    mb_per_s = file_bytes / _MiB / best_s["load_trace"]
    return {"file_mb": round(file_bytes / _MiB, 1), "nodes": num_nodes,
            "load_s": round(best_s["load_trace"], 3), "mb_per_s": round(mb_per_s, 1),
            "peak_rss_gib": round(peak_gib["load_trace"], 3),
            "whole_load_s": round(best_s["load_trace_whole"], 3),
            "whole_peak_rss_gib": round(peak_gib["load_trace_whole"], 3),
            "peak_rss_over_whole": round(peak_gib["load_trace"] / peak_gib["load_trace_whole"], 3),
            "rewrite_s": round(best_s["rewrite"], 3),
            "rewrite_peak_rss_gib": round(peak_gib["rewrite"], 3),
            "whole_rewrite_s": round(best_s["rewrite_whole"], 3),
            "whole_rewrite_peak_rss_gib": round(peak_gib["rewrite_whole"], 3),
            "cache_write_load_s": round(best_s["cache_write"], 3),
            "cached_load_s": round(best_s["cache_hit"], 3),
            "cached_peak_rss_gib": round(peak_gib["cache_hit"], 3),
            "cached_over_load": round(best_s["cache_hit"] / best_s["load_trace"], 3),
            "targets_met": {"peak_rss_gib": peak_gib["load_trace"] <= LARGE_TARGETS["peak_rss_gib"],
                            "mb_per_s": mb_per_s >= LARGE_TARGETS["mb_per_s"]}}


if __name__ == "__main__":
    main()
