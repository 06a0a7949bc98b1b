"""Fuzz campaign: mutated real traces through load, pre-flight and a meta dry run of the replay.

Every case (scripts/trace_mutations.py: a window of a demo or public trace with one to three
mutations, in one of several file forms) is written as ``rank-<r>.et.json[.gz]`` into a
worker's own folder and run through ``load_trace``, ``orchestrator.preflight.validate.preflight``
(``replay.mode=compute``, in-process) and the rank's replay (``RankSession``) on ``meta`` (one
iteration, no Ray). A pool of long-lived worker processes runs the cases; a case that outlives
``--timeout-s`` has its worker killed (by pid) and restarted. Outcomes:

* ``clear_errors``: a project error (``actors.errors.TracefleetError``), raised or as the
  replay report's failure;
* ``replayed``: the dry run finished (skipped ops and OOMs are outcomes of a replay);
* ``tracebacks``: any other exception; ``hangs``: the timeout; ``crashes``: the worker died.

Prints one JSON line ``{n, seed, clear_errors, replayed, tracebacks, hangs, crashes,
examples}`` (``examples``: the first failures of each bad kind, with mutation and message).

    python scripts/fuzz_traces.py --n 2000 --seed 0 [--workers 2] [--timeout-s 60]
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import tempfile
import time
from multiprocessing.connection import wait
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import trace_mutations  # noqa: E402

BAD = ("tracebacks", "hangs", "crashes")
OUTCOMES = ("clear_errors", "replayed") + BAD
WORKER_MEMORY_BYTES = 6 << 30  # address space per worker: a huge allocation fails, not the host
START_TIMEOUT_S = 300


def _run_case(corpus, seed: int, index: int, folder: Path) -> dict:
    """One case, in a worker: its outcome, stage and message."""
    import traceback

    import torch

    from actors.errors import TracefleetError
    from actors.replay.config import ReplayConfig
    from actors.replay.session import RankSession
    from actors.trace import load_trace
    from orchestrator.preflight.validate import preflight

    label, rank, suffix, data, mutations = trace_mutations.make_case(corpus, seed, index)
    case = {"case": index, "base": label, "mutations": mutations}
    for old in folder.iterdir():
        old.unlink()
    path = folder / f"rank-{rank}.et{suffix}"
    path.write_bytes(data)
    stage = "load"
    try:
        trace = load_trace(path, rank=rank)
        stage = "preflight"
        preflight(folder, mode="compute", executor="inline")
        stage = "replay"
        cfg = ReplayConfig(mode="compute", device="meta", iters=1, warmup_iters=0)
        report = RankSession(cfg, rank=rank, device=torch.device("meta")).run(trace)
    except TracefleetError as e:
        return {**case, "outcome": "clear_errors", "stage": stage, "message": str(e)[:300]}
    except Exception as e:  # RecursionError and MemoryError included
        frames = traceback.extract_tb(e.__traceback__)[-3:]
        return {**case, "outcome": "tracebacks", "stage": stage,
                "message": f"{type(e).__name__}: {str(e)[:200]}",
                "where": [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in frames]}
    if report["status"] in ("failed", "timeout"):  # the engine turned an exception into these
        kind = report["error"].split(": ", 2)[1] if report["error"].count(": ") >= 2 else ""
        ours = kind in _project_error_names()
        return {**case, "outcome": "clear_errors" if ours else "tracebacks", "stage": "replay",
                "message": report["error"][:300]}
    return {**case, "outcome": "replayed", "stage": "replay", "status": report["status"]}


def _project_error_names() -> set[str]:
    from actors.errors import TracefleetError

    out, todo = set(), [TracefleetError]
    while todo:
        cls = todo.pop()
        out.add(cls.__name__)
        todo += cls.__subclasses__()
    return out


def _worker(conn, corpus_path: str, folder: str) -> None:
    """Load the corpus and the replay stack once, then run cases sent as (seed, index)."""
    import logging
    import resource

    import torch  # imported before the first case: its cost is not a case's

    from orchestrator.preflight import validate  # noqa: F401
    logging.disable(logging.CRITICAL)
    resource.setrlimit(resource.RLIMIT_AS, (WORKER_MEMORY_BYTES, WORKER_MEMORY_BYTES))
    torch.set_num_threads(1)
    corpus = [(label, rank, bytes.fromhex(data))
              for label, rank, data in orjson.loads(Path(corpus_path).read_bytes())]
    conn.send("ready")
    while True:
        job = conn.recv()
        if job is None:
            return
        conn.send(_run_case(corpus, job[0], job[1], Path(folder)))


class Worker:
    """A worker process with its pipe, folder and current case."""

    def __init__(self, ctx, corpus_path: str, root: Path, k: int):
        self.folder = root / f"w{k}-{time.monotonic_ns()}"
        self.folder.mkdir()
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker, args=(child, corpus_path, str(self.folder)),
                                daemon=True)
        self.proc.start()
        child.close()
        if not self.conn.poll(START_TIMEOUT_S) or self.conn.recv() != "ready":
            self.stop()
            raise SystemExit(f"fuzz worker did not start within {START_TIMEOUT_S} s")
        self.case: int | None = None
        self.deadline = 0.0

    def send(self, seed: int, index: int, timeout_s: float) -> None:
        self.case, self.deadline = index, time.monotonic() + timeout_s
        self.conn.send((seed, index))

    def stop(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()  # our own child, by its handle
        self.proc.join(10)


def campaign(n: int, seed: int, num_workers: int, timeout_s: float, sources=None,
             max_examples: int = 4, cases=None) -> dict:
    """Run cases ``0..n-1`` (or just ``cases``); returns the summary line's dict
    (``max_examples`` per bad outcome)."""
    corpus = trace_mutations.build_corpus(sources or trace_mutations.DEFAULT_SOURCES, seed)
    counts = dict.fromkeys(OUTCOMES, 0)
    examples: dict[str, list] = {k: [] for k in BAD}
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="fuzz-traces-") as tmp:
        root = Path(tmp)
        corpus_path = root / "corpus.json"
        corpus_path.write_bytes(orjson.dumps([(lab, r, d.hex()) for lab, r, d in corpus]))
        workers = [Worker(ctx, str(corpus_path), root, k) for k in range(num_workers)]
        todo = list(cases if cases else range(n))[::-1]

        def record(result: dict) -> None:
            counts[result["outcome"]] += 1
            if result["outcome"] in BAD and len(examples[result["outcome"]]) < max_examples:
                examples[result["outcome"]].append(result)

        try:
            for w in workers:
                if todo:
                    w.send(seed, todo.pop(), timeout_s)
            while any(w.case is not None for w in workers):
                busy = [w for w in workers if w.case is not None]
                ready = wait([w.conn for w in busy], timeout=max(0.0, min(w.deadline for w in busy)
                                                                 - time.monotonic()))
                for i, w in enumerate(workers):
                    if w.case is None:
                        continue
                    if w.conn in ready:
                        try:
                            record(w.conn.recv())
                        except (EOFError, OSError):  # died mid-case
                            w.proc.join(10)
                            record(_lost(seed, corpus, w.case, "crashes",
                                         f"worker exited with {w.proc.exitcode}"))
                            workers[i] = w = _restart(w, ctx, corpus_path, root, i)
                    elif time.monotonic() >= w.deadline:
                        record(_lost(seed, corpus, w.case, "hangs", f"no result in {timeout_s:g} s"))
                        workers[i] = w = _restart(w, ctx, corpus_path, root, i)
                    else:
                        continue
                    w.case = None
                    if todo:
                        w.send(seed, todo.pop(), timeout_s)
        finally:
            for w in workers:
                if w.proc.is_alive():
                    w.conn.send(None)
                w.stop()
    return {"n": sum(counts.values()), "seed": seed, **counts,
            "examples": {k: v for k, v in examples.items() if v}}


def _restart(w: Worker, ctx, corpus_path, root, k) -> Worker:
    w.stop()
    return Worker(ctx, str(corpus_path), root, k)


def _lost(seed, corpus, index, outcome, message) -> dict:
    label, _, _, _, mutations = trace_mutations.make_case(corpus, seed, index)
    return {"case": index, "base": label, "mutations": mutations, "outcome": outcome,
            "message": message}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=2000, help="number of cases")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=2, help="worker processes")
    ap.add_argument("--timeout-s", type=float, default=60.0, help="per case, then the worker is "
                                                                  "killed and restarted")
    ap.add_argument("--examples", type=int, default=4, help="failures shown per bad outcome")
    ap.add_argument("--case", type=int, action="append", help="run only this case index "
                                                              "(repeatable): re-creates it")
    ap.add_argument("--sources", nargs="+", help="trace files, folders or archives to mutate "
                                                 "(default: the demo and public traces)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    summary = campaign(args.n, args.seed, args.workers, args.timeout_s, args.sources,
                       args.examples, args.case)
    summary["wall_s"] = round(time.perf_counter() - t0, 1)
    print(orjson.dumps(summary).decode())
    return 0 if not any(summary[k] for k in BAD) else 1


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
