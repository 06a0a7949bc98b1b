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

    python scripts/bench_load.py --nodes 1000000 --reps 3 [--gc-ab]
"""
from __future__ import annotations

import argparse
import gc
import json
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
CHILD_TIMEOUT_S = 3600
_MiB = 1 << 20


def layout(gc_ab: bool = False) -> dict:
    """The keys of the JSON line (scripts/json_layout.py); ``gc_ab``: with ``--gc-ab``'s."""
    readers = READERS + (("load_trace_gc_on",) if gc_ab else ())
    return {"nodes": None, "file_mb": None, "reps": None, "json_load_s": None,
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

    if reader.startswith("json_load"):
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
        start = time.perf_counter()
        trace = load_trace(path) if reader == "load_trace" else _load_trace(Path(path), None, None)
        elapsed_s = time.perf_counter() - start
        count = trace.num_nodes
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    print(json.dumps({"s": elapsed_s, "nodes": count, "peak_rss_mb": peak_kib / 1024}))


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
    parser.add_argument("--child", nargs=2, metavar=("READER", "PATH"), help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="smoke run: smallest inputs, seconds (the test suite runs it)")
    args = parser.parse_args(argv)
    if args.quick:
        args.nodes, args.reps = 20_000, 1
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
    emit(result, layout(args.gc_ab))


if __name__ == "__main__":
    main()
