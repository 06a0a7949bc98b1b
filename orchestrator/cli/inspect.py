"""``tracefleet-inspect PATH [--json] [--top N] [--debug]``: what is in a trace, or a folder of ranks.

PATH is what ``trace.dir`` accepts: one trace file (``.json``, ``.json.gz``), a folder of
rank traces, or a ``.tar``/``.tar.gz`` archive of them (`actors.trace.source.discover`; the
rank is the integer right before ``.json``, e.g. ``rank-3.et.json.gz``, ``dlrm_eg_3.json``).
Traces are loaded one at a time. The figures come from `actors.trace.stats.trace_stats`; this
module only loads, formats and reports errors.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from actors.errors import ConfigError, TraceError
from actors.replay.config import parse_bytes
from actors.trace import load_trace
from actors.trace.archive import DEFAULT_MAX_DECOMPRESSED_BYTES
from actors.trace.node_check import implausible_nodes
from actors.trace.source import discover
from actors.trace.stats import trace_stats
from orchestrator.cli.app import guarded
from orchestrator.units import human_bytes, one_line

_EPILOG = ("Parameters: storages that exist before the trace, are floating point, are read "
           "before anything writes them and are later updated in place by an op other than "
           "copy_ (the optimizer step); see actors/trace/stats.py. Memory: the liveness lower "
           "bound, the peak of live storage bytes if every storage lived exactly from its first "
           "to its last use.")


def inspect_path(path, top: int = 10,
                 max_decompressed_bytes: int = DEFAULT_MAX_DECOMPRESSED_BYTES) -> dict:
    """Stats of one trace, or of every rank trace of a folder or archive plus a cross-rank
    summary."""
    path = Path(path)
    sources = discover(path, max_decompressed_bytes)
    ranked = path.is_dir() or len(sources) > 1
    # one trace at a time: a folder of large traces need not fit in memory at once
    per_file = [{**trace_stats(load_trace(src, rank=rank if ranked else None), top),
                 "implausible_nodes": implausible_nodes(src)} for rank, src in sources.items()]
    return {"path": str(path), "files": per_file,
            "cross_rank": cross_rank(per_file) if ranked else None}


def cross_rank(per_file: list[dict]) -> dict:
    """Min and max over ranks of the figures that should agree (or be compared) across ranks."""
    def span(values):
        return [min(values), max(values)]

    return {"num_ranks": len(per_file),
            "num_ops": span([s["num_ops"] for s in per_file]),
            "num_collective_calls": span([sum(r["count"] for r in s["collectives"]) for s in per_file]),
            "collective_out_bytes": span([sum(r["out_bytes"] for r in s["collectives"])
                                          for s in per_file]),
            "param_bytes": span([s["params"]["bytes"] for s in per_file]),
            "lower_bound_bytes": span([s["memory"]["lower_bound_bytes"] for s in per_file])}


def _print_human(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False)
    for s in report["files"]:
        title = f"rank {s['rank']}: {s['path']}" if s["rank"] is not None else s["path"]
        console.rule(title)
        summary = Table(show_header=False, box=None)
        steps = ", ".join(s["steps"]) or "none (every op kept)"
        for key, value in [
            ("schema", s["schema"]), ("nodes", f"{s['num_nodes']:,}"),
            ("replayable ops", f"{s['num_ops']:,} ({s['num_op_names']} distinct; "
                               f"{s['num_dropped_ops']} outside ProfilerStep windows dropped"
                               + (f"; {s['num_orphan_ops']} under a range never closed, "
                                  "placed by position" if s["num_orphan_ops"] else "")
                               + (f"; {s['num_wrapper_ops']} on tensor-subclass wrappers that "
                                  "reached no frame dropped (no work, no memory)"
                                  if s["num_wrapper_ops"] else "") + ")"),
            ("steps", steps),
            ("parameter-like", f"{s['params']['num_storages']} storages, "
                               f"{human_bytes(s['params']['bytes'])}"),
            ("memory lower bound", f"{human_bytes(s['memory']['lower_bound_bytes'])} "
                                   f"(made before the trace: {human_bytes(s['memory']['external_bytes'])})"),
        ]:
            summary.add_row(key, value)
        console.print(summary)
        ops = Table("op", "count", title=f"top {len(s['op_histogram'])} ops", title_justify="left")
        for row in s["op_histogram"]:
            ops.add_row(one_line(row["name"]), f"{row['count']:,}")
        console.print(ops)
        if s["collectives"]:
            colls = Table("group", "kind", "calls", "sent", "received",
                          title=f"collectives ({s['num_waits']} waits)", title_justify="left")
            for row in s["collectives"]:
                colls.add_row(row["pg"] if row["pg"] is not None else "(not recorded)", row["kind"],
                              str(row["count"]), human_bytes(row["in_bytes"]),
                              human_bytes(row["out_bytes"]))
            console.print(colls)
        else:
            console.print("collectives: none")
        if s["process_groups"]:
            groups = Table("name", "desc", "backend", "size", "ranks", title="process groups",
                           title_justify="left")
            for g in s["process_groups"]:
                groups.add_row(g["name"], g["desc"], g["backend"], str(g["group_size"]),
                               ", ".join(map(str, g["ranks"])) or "all")
            console.print(groups)
        else:
            console.print("process groups: none recorded")
        bad = s["implausible_nodes"]
        if bad["num_nodes"]:
            console.print(f"[yellow]warning: {bad['num_nodes']:,} node(s) hold arguments the "
                          "replay would refuse in an op it replays (it does not read these: "
                          "nested nodes); the trace may be damaged:[/yellow]")
            for line in bad["examples"]:
                console.print(f"  {line}", markup=False)
            if bad["num_nodes"] > len(bad["examples"]):
                console.print(f"  ... {bad['num_nodes'] - len(bad['examples']):,} more (--json)")
    x = report["cross_rank"]
    if x is not None:
        def span(pair, fmt=str):
            return fmt(pair[0]) if pair[0] == pair[1] else f"{fmt(pair[0])} .. {fmt(pair[1])}"

        console.rule("across ranks")
        console.print(f"{x['num_ranks']} ranks; ops {span(x['num_ops'])}; collective calls "
                      f"{span(x['num_collective_calls'])}; received {span(x['collective_out_bytes'], human_bytes)}; "
                      f"parameters {span(x['param_bytes'], human_bytes)}; memory lower bound "
                      f"{span(x['lower_bound_bytes'], human_bytes)}")


def main(argv: list[str] | None = None) -> int:
    """Console-script entry; returns the exit status (2 on a user error)."""
    parser = argparse.ArgumentParser(prog="tracefleet-inspect", epilog=_EPILOG,
                                     description="Summarize an Execution Trace file or a folder "
                                                 "of rank traces.")
    parser.add_argument("path", help="a trace file, a folder of rank traces or a .tar[.gz] of them")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    parser.add_argument("--top", type=int, default=10, metavar="N", help="ops in the histogram (default 10)")
    parser.add_argument("--max-decompressed-bytes", default="4GiB", metavar="SIZE",
                        help="refuse gzip data or archive members expanding past SIZE (default 4GiB)")
    parser.add_argument("--strict", action="store_true",
                        help="exit 2 when a node the replay does not read holds implausible "
                             "arguments (an impossible shape, a retyped input); else a warning")
    parser.add_argument("--debug", action="store_true", help="show the traceback of errors")
    args = parser.parse_args(argv)

    def body() -> int:
        if args.top < 0:
            raise ConfigError(f"--top must be >= 0, got {args.top}")
        limit = parse_bytes(args.max_decompressed_bytes, "--max-decompressed-bytes")
        report = inspect_path(args.path, args.top, limit)
        if args.json:
            sys.stdout.write(json.dumps(report) + "\n")
        else:
            _print_human(report)
        damaged = [(f["path"], f["implausible_nodes"]) for f in report["files"]
                   if f["implausible_nodes"]["num_nodes"]]
        if args.strict and damaged:
            path, bad = damaged[0]
            raise TraceError(path, f"--strict: {bad['num_nodes']:,} node(s) the replay does not "
                                   f"read hold implausible arguments, first {bad['examples'][0]}")
        return 0

    # OSError: an unreadable folder, a permission
    return guarded("tracefleet-inspect", body, args.debug, also=(OSError,))


if __name__ == "__main__":
    sys.exit(main())
