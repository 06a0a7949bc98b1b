"""Fuzz campaign for what tracefleet takes from elsewhere (issue 33 item 8): memory snapshots
(``tracefleet-compare``), a prediction dir's ``prediction.json``, a run dir's ``summary.json``
(``tracefleet-report``), a capture's ``meta.json`` (pre-flight's and the predictor's reads),
numbers and choices on the command line, and the Python API's arguments. Traces have their own
campaign (scripts/fuzz_traces.py).

Each case mutates one field of a whole, valid input (deleted, retyped, negative, 10**400, NaN,
nested 200,000 lists deep, 1 MiB long) or the file itself (cut, not a pickle, a planted type),
then runs the console script in this process, as a user would call it. Outcomes:

* ``clear``: exit 2 with one ``<prog>: error:`` line;
* ``accepted``: exit 0 (a field the command does not need, or a value it may take);
* ``wrong``: exit 0 although the value can never be right (a negative or 2**63+ byte count);
* ``tracebacks``: anything else (an exception, a traceback printed, another exit status).

Prints one JSON line ``{num_cases, clear, accepted, wrong, tracebacks, examples}``.

    python scripts/fuzz_inputs.py [--only snapshot|prediction|run_dir|meta|config|api]

The config and API cases must all be refused before any capture (every one is a bad value);
the meta.json cases are each refused or read as a capture's world and figures.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import io
import math
import pickle
import sys
import tempfile
import threading
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from actors.trace.meta_file import META_JSON  # noqa: E402 (pure trace code: no torch)

MiB = 1 << 20
DEEP = 200_000  # nesting depth of the "deep" value
BAD = ("wrong", "tracebacks")


def _deep():
    value: list = []
    for _ in range(DEEP):
        value = [value]
    return value


# name -> (value factory, whether a byte count / index holding it must be refused)
MUTATIONS = {
    "deleted": (None, False),
    "none": (lambda: None, True),
    "string": (lambda: "12", True),
    "negative": (lambda: -4096, True),
    "huge": (lambda: 10 ** 400, True),
    "int64_edge": (lambda: 1 << 63, True),
    "nan": (lambda: math.nan, True),
    "bool": (lambda: True, True),
    "float": (lambda: 4096.5, True),
    "list": (lambda: [1, 2], True),
    "dict": (lambda: {"a": 1}, True),
    "deep": (_deep, True),
    "long_string": (lambda: "x" * MiB, True),
}


def _dumps(obj) -> bytes:
    """``pickle.dumps`` of a value nested ``DEEP`` levels: in a thread with a stack and a
    recursion limit to match (the pickler recurses per level)."""
    out: list[bytes] = []
    limit = sys.getrecursionlimit()
    threading.stack_size(1 << 30)
    sys.setrecursionlimit(4 * DEEP)
    try:
        worker = threading.Thread(target=lambda: out.append(pickle.dumps(obj)))
        worker.start()
        worker.join()
    finally:
        sys.setrecursionlimit(limit)
        threading.stack_size(0)
    return out[0]


def _frames(name: str) -> list[dict]:
    return [{"filename": "train.py", "line": 7, "name": name}]


def base_snapshot() -> dict:
    """A small whole snapshot in torch's ``_snapshot()`` layout: one segment, four
    allocations, three freed."""
    seg = 64 * MiB
    trace = [{"action": "segment_alloc", "addr": 0, "size": seg, "stream": 0,
              "frames": _frames("first")}]
    sizes = [1 * MiB, 4 * MiB, 2 * MiB, 8 * MiB]
    addr = 0
    for k, size in enumerate(sizes):
        trace.append({"action": "alloc", "addr": addr, "size": size, "stream": 0,
                      "frames": _frames(f"op{k}")})
        if k < len(sizes) - 1:
            trace.append({"action": "free_completed", "addr": addr, "size": size, "stream": 0})
        addr += size
    blocks = [{"address": addr - 8 * MiB, "size": 8 * MiB, "requested_size": 8 * MiB,
               "state": "active_allocated", "frames": _frames("op3")}]
    return {"segments": [{"device": 0, "address": 0, "total_size": seg, "stream": 0,
                          "blocks": blocks}], "device_traces": [trace]}


def _leaves(obj, path=()):
    """Every (path, value) of ``obj``'s scalar fields and its lists/dicts themselves."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield path + (key,), value
            yield from _leaves(value, path + (key,))
    elif isinstance(obj, list):
        for i, value in enumerate(obj):
            yield path + (i,), value
            yield from _leaves(value, path + (i,))


def _mutated(base, path, mutation: str):
    obj = copy.deepcopy(base)
    parent = obj
    for key in path[:-1]:
        parent = parent[key]
    factory, _ = MUTATIONS[mutation]
    if factory is None:
        del parent[path[-1]]
    else:
        parent[path[-1]] = factory()
    return obj


def _pickled_mutation(base, path, mutation: str) -> bytes:
    return _dumps(_mutated(base, path, mutation))


_BYTE_FIELDS = {"size", "total_size", "requested_size", "addr", "device"}


def snapshot_cases():
    """(name, files, argv, must_refuse) of the snapshot family: every field of the recorded
    snapshot mutated every way, plus whole-file cases."""
    base = base_snapshot()
    pred = pickle.dumps(base)
    seen_paths = set()
    for path, _ in _leaves(base):
        field = path[-1]
        # one case per field kind and place, not per list index beyond the first two
        key = tuple(p if isinstance(p, str) else min(p, 2) for p in path)
        if key in seen_paths:
            continue
        seen_paths.add(key)
        for mutation, (_, refuse) in MUTATIONS.items():
            if mutation == "deleted" and isinstance(field, int):
                continue
            name = "snapshot:" + ".".join(map(str, path)) + ":" + mutation
            # pickled when the case runs (the test runs a ninth): 634 cases took ~22 s to make
            data = functools.partial(_pickled_mutation, base, path, mutation)
            addr_ok = field == "addr" and mutation == "int64_edge"  # 2**63 is an address
            yield (name, {"recorded.pickle": data, "pred/snapshot_rank0.pickle": pred},
                   refuse and field in _BYTE_FIELDS and not addr_ok)
    whole = {"cut": pickle.dumps(base)[:100], "empty": b"", "not_pickle": b"{json}",
             "a_set": pickle.dumps({"segments": [], "device_traces": [{1, 2}]}),
             "a_global": pickle.dumps(Path("/etc/passwd")),
             "a_list": pickle.dumps([1, 2, 3]), "top_int": pickle.dumps(7)}
    for label, data in whole.items():
        yield (f"snapshot:file:{label}", {"recorded.pickle": data,
                                          "pred/snapshot_rank0.pickle": pred}, True)


def compare_argv(folder: Path, name: str) -> list[str]:
    extra = ["--device", "3"] if name.endswith("device_arg") else []
    return [str(folder / "recorded.pickle"), str(folder / "pred"), *extra]


def prediction_cases():
    """A prediction dir whose prediction.json is cut or odd (the rank is read from it)."""
    pred = pickle.dumps(base_snapshot())
    for label, data in {"cut": b'{"rank": ', "list": b"[1]", "rank_str": b'{"rank": "0"}',
                        "rank_huge": b'{"rank": 1e400}', "deep": b"[" * 100_000}.items():
        yield (f"prediction:{label}", {"recorded.pickle": pred, "pred/prediction.json": data,
                                       "pred/snapshot_rank0.pickle": pred}, label == "cut")
    yield ("prediction:device_arg", {"recorded.pickle": pred,
                                     "pred/snapshot_rank0.pickle": pred}, True)


def base_summary() -> dict:
    """A whole run summary as ``tracefleet`` writes it (two ranks)."""
    def rank(r):
        return {"rank": r, "status": "ok", "node_ip": "10.0.0.1", "iteration_time_s": 0.05,
                "iteration_times_s": [0.05, 0.051], "accounted_peak_bytes": 10 * MiB,
                "peak_memory_bytes": 10 * MiB, "liveness_lower_bound_bytes": 6 * MiB,
                "num_flushes": 2, "coverage": 1.0,
                "memory_timeline": [[i, (2 + i % 7) * MiB] for i in range(0, 50, 5)]}
    return {"status": "ok", "world_size": 2, "error": None, "iteration_time_s": 0.06,
            "iteration_time_median_s": 0.055, "measured_peak_bytes": 11 * MiB,
            "accounted_peak_bytes": 10 * MiB, "peak_memory_bytes": 11 * MiB,
            "peak_memory_source": "measured", "liveness_lower_bound_bytes": 6 * MiB,
            "device_memory_capacity_bytes": 16 * MiB, "device_memory_threshold": 0.5,
            "num_flushes": 4, "coverage": 1.0, "mode": "full", "allocation_mode": "lazy",
            "ranks": [rank(0), rank(1)]}


def run_dir_cases():
    """summary.json's top-level fields and rank 0's fields, each retyped a few ways."""
    base = base_summary()
    for path in [(k,) for k in base] + [("ranks", 0, k) for k in base["ranks"][0]]:
        for mutation in ("deleted", "string", "negative", "list", "dict"):
            try:
                data = orjson.dumps(_mutated(base, path, mutation))
            except TypeError:
                continue
            yield (f"run_dir:{'.'.join(map(str, path))}:{mutation}",
                   {"run/summary.json": data}, False)
    for label, data in {"cut": orjson.dumps(base)[:80], "deep": b"[" * 100_000,
                        "not_object": b"[1, 2]"}.items():
        yield f"run_dir:file:{label}", {"run/summary.json": data}, True


def base_meta() -> dict:
    """A capture's meta.json as tracefleet-capture writes it (the fields tracefleet reads)."""
    return {"world_size": 2, "workload": {"model": "gpt"},
            "environment": {"EXAMPLE_COMPILE": "0"},
            "ranks": [{"rank": r, "iteration_times_s": [0.5, 0.4], "iteration_time_s": 0.4,
                       "profiler_op_cost_s": 1e-5, "num_threads": 2,
                       "machine": {"num_cpus": 2}} for r in range(2)]}


def meta_cases():
    """meta.json's fields and rank 0's, each retyped; read as pre-flight and predict do."""
    base = base_meta()
    for path in [(k,) for k in base] + [("ranks", 0, k) for k in base["ranks"][0]]:
        for mutation in ("deleted", "string", "negative", "huge", "nan", "bool", "list", "dict"):
            try:
                data = orjson.dumps(_mutated(base, path, mutation))
            except TypeError:  # 10**400 and NaN are not JSON: written by hand
                value = {"huge": "1" + "0" * 400, "nan": "NaN"}[mutation]
                doc = orjson.dumps(_mutated(base, path, "string")).decode()
                data = doc.replace('"12"', value, 1).encode()
            yield f"meta:{'.'.join(map(str, path))}:{mutation}", {META_JSON: data}, False
    for label, data in {"cut": orjson.dumps(base)[:50], "list": b"[]", "deep": b"[" * 100_000,
                        "huge": b" " * (65 << 20)}.items():
        yield f"meta:file:{label}", {META_JSON: data}, True


# Overrides that are each wrong: refused (ConfigError) before any capture or cluster.
CONFIG_CASES = [
    "predict.capture_timeout_s=nan", "predict.capture_timeout_s=-5", "predict.capture_stall_s=-1",
    "predict.capture_timeout_s=inf", "predict.error_band=1.5", "predict.error_band=nan",
    "target.device_memory=1e400GiB", "target.device_memory=-1GiB", "target.device_memory=abc",
    "target.device_memory=true", "replay.collective_timeout_s=nan", "replay.iters=-1",
    "world_size=0", "world_size=-3", "world_size=2.7", "world_size=abc", "world_size=true",
    "world_size=1000000000", "workload=no_such_preset", "workload.no_such_field=1",
    "workload.seq_len=-1", "workload.batch_size=0", "workload.precision=fp7",
    "workload.parallel=nope", "target=none", "replay.mode=sideways",
    "workload.activation_checkpointing=sometimes",
    "trace.dir=/no/such/dir", "zero3=per_module",
]


def config_cases():
    for override in CONFIG_CASES:
        yield f"config:{override}", {}, True


# predict()'s arguments that are each wrong (the API must be as strict as the command line).
API_CASES = {
    "world_size_float": dict(workload="gpt", world_size=2.7),
    "world_size_bool": dict(workload="gpt", world_size=True),
    "world_size_str": dict(workload="gpt", world_size="two"),
    "world_size_zero": dict(workload="gpt", world_size=0),
    "workload_int": dict(workload=3, world_size=2),
    "workload_lambda": dict(workload=lambda ctx: ctx, world_size=2),
    "workload_missing_file": dict(workload="/no/such/step.py:build", world_size=2),
    "unknown_preset": dict(workload="no_such_preset", world_size=2),
    "unknown_key": dict(workload="gpt", world_size=2, workload__no_such_field=1),
    "bad_target": dict(workload="gpt", world_size=2, target="h900"),
    "nan_band": dict(workload="gpt", world_size=2, predict__error_band=float("nan")),
    "quote_injection": dict(workload="gpt", world_size=2, workload__seq_len="1,world_size=9"),
}


def api_cases():
    for label in API_CASES:
        yield f"api:{label}", {}, True


def _meta_read(folder: Path) -> None:
    """What pre-flight and the predictor read of a meta.json beside traces."""
    from actors.trace.meta_file import (check_ranks, environment_changes, meta_path_of,
                                        rank_seconds, read_meta, recorded_world_size, workload)

    path = meta_path_of(folder)
    meta = read_meta(path)
    check_ranks(path, meta)
    recorded_world_size(folder)
    rank_seconds(path, meta, 0, "iteration_time_s")
    rank_seconds(path, meta, 1, "profiler_op_cost_s")
    environment_changes(path, meta)
    workload(path, meta)


def _in_process(name: str, folder: Path) -> str | None:
    """Run one meta/config/api case; the project error's message, None when accepted."""
    from actors.errors import TracefleetError

    try:
        if name.startswith("meta:"):
            _meta_read(folder)
        elif name.startswith("config:"):
            from orchestrator.cli.predict import predict_config
            from tracefleet.api import _compose

            override = name[len("config:"):]
            job = [] if override.startswith("world_size=") else ["world_size=2"]
            _compose(predict_config, [*job, override]).validate()
        else:
            from tracefleet import predict

            predict(**API_CASES[name[len("api:"):]])
    except TracefleetError as e:
        return str(e).splitlines()[0][:300] or type(e).__name__
    return None


def run_case(name: str, files: dict, must_refuse: bool, folder: Path) -> dict:
    """Write ``files`` (bytes, or a function making them) into a fresh ``folder``, run the
    command; the case's outcome."""
    from orchestrator.cli.compare import main as compare_main
    from orchestrator.cli.report import main as report_main

    for rel, data in files.items():
        target = folder / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data() if callable(data) else data)
    if name.split(":")[0] in ("meta", "config", "api"):
        try:
            message = _in_process(name, folder)
        except BaseException as e:  # noqa: BLE001 (the campaign counts what escapes)
            return {"case": name, "outcome": "tracebacks",
                    "message": f"{type(e).__name__}: {e}"[:300]}
        outcome = "clear" if message else "wrong" if must_refuse else "accepted"
        return {"case": name, "outcome": outcome, "message": message or ""}
    if name.startswith("run_dir"):
        prog, call = "tracefleet-report", lambda: report_main([str(folder / "run")])
    else:
        prog, call = "tracefleet-compare", lambda: compare_main(compare_argv(folder, name))
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            status = call()
    except BaseException as e:  # noqa: BLE001 (the campaign counts what escapes)
        return {"case": name, "outcome": "tracebacks", "message": f"{type(e).__name__}: {e}"[:300]}
    lines = err.getvalue().strip().splitlines()
    if status == 2 and len(lines) == 1 and lines[0].startswith(f"{prog}: error: "):
        return {"case": name, "outcome": "clear", "message": lines[0][:300]}
    if status == 0 and "Traceback" not in err.getvalue():
        return {"case": name, "outcome": "wrong" if must_refuse else "accepted", "message": ""}
    return {"case": name, "outcome": "tracebacks",
            "message": f"exit {status}: " + " | ".join(lines[-3:])[:300]}


FAMILIES = {"snapshot": snapshot_cases, "prediction": prediction_cases, "run_dir": run_dir_cases,
            "meta": meta_cases, "config": config_cases, "api": api_cases}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=tuple(FAMILIES))
    parser.add_argument("--show", action="store_true", help="print every case's outcome")
    args = parser.parse_args()
    sys.setrecursionlimit(10_000)  # as the console scripts run
    counts = {k: 0 for k in ("clear", "accepted") + BAD}
    examples: list[dict] = []
    num = 0
    for family, cases in FAMILIES.items():
        if args.only and family != args.only:
            continue
        for name, files, must_refuse in cases():
            with tempfile.TemporaryDirectory(prefix="tracefleet-fuzz-") as tmp:
                result = run_case(name, files, must_refuse, Path(tmp))
            num += 1
            counts[result["outcome"]] += 1
            if args.show:
                print(f"{result['outcome']:10} {name} {result['message'][:160]}", file=sys.stderr)
            if result["outcome"] in BAD and len(examples) < 20:
                examples.append(result)
    print(orjson.dumps({"num_cases": num, **counts, "examples": examples}).decode())


if __name__ == "__main__":
    main()
