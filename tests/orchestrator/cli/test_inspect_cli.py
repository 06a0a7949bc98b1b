"""`tracefleet-inspect`: figures checked against the loaded trace, JSON and tables, error exits."""
from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from actors.trace import compute_liveness, load_trace, read_json
from orchestrator.config import REPO_ROOT
from orchestrator.cli.inspect import main

REPO = REPO_ROOT
DEMO_DP = REPO / "demo" / "traces" / "gpt_dp_4"
RESNET50_NUM_PARAMS = 25_557_032  # torchvision resnet50: 161 parameter tensors
BYTES_PER_ELEMENT = {"float32": 4, "int64": 8, "int32": 4}


def _run_json(capsys, *args) -> dict:
    assert main([*map(str, args), "--json"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1  # exactly one JSON object on one line
    return json.loads(out)


def _expected_collectives(trace) -> list[dict]:
    rows = defaultdict(lambda: [0, 0, 0])
    for op in trace.ops:
        c = op.collective
        if c is not None and c.kind != "wait":
            row = rows[(c.pg_name, c.kind)]
            row[0] += 1
            row[1] += c.in_nelems * BYTES_PER_ELEMENT[c.dtype]
            row[2] += c.out_nelems * BYTES_PER_ELEMENT[c.dtype]
    return sorted([{"pg": pg, "kind": kind, "count": n, "in_bytes": i, "out_bytes": o}
                   for (pg, kind), (n, i, o) in rows.items()],
                  key=lambda r: (r["pg"] is None, r["pg"] or "", r["kind"]))


def _check_against_trace(stats: dict, path: Path, top: int) -> None:
    trace = load_trace(path)
    assert stats["schema"] == trace.schema
    assert stats["num_nodes"] == len(read_json(path)["nodes"])
    assert stats["num_ops"] == len(trace.ops)
    names = Counter(op.name for op in trace.ops)
    assert [(r["name"], r["count"]) for r in stats["op_histogram"]] == names.most_common(top)
    assert stats["num_op_names"] == len(names)
    assert stats["collectives"] == _expected_collectives(trace)
    assert stats["num_waits"] == sum(1 for op in trace.collectives if op.collective.kind == "wait")
    assert [(g["name"], g["group_size"]) for g in stats["process_groups"]] == \
           [(g.name, g.group_size) for g in trace.process_groups]
    live = compute_liveness(trace.ops, trace.num_storages)
    assert stats["memory"]["lower_bound_bytes"] == max(live.live_bytes) == live.lower_bound_bytes


def test_one_nccl_file(capsys, public_trace_dir):
    path = public_trace_dir / "resnet_et.json.gz"
    report = _run_json(capsys, path, "--top", 4)
    assert report["path"] == str(path) and report["cross_rank"] is None
    (stats,) = report["files"]
    _check_against_trace(stats, path, 4)
    assert len(stats["op_histogram"]) == 4
    assert stats["steps"] == [s.name for s in load_trace(path).steps] and len(stats["steps"]) == 3
    assert stats["params"] == {"num_storages": 161, "bytes": 4 * RESNET50_NUM_PARAMS}


def test_gloo_folder(capsys):
    meta = json.loads((DEMO_DP / "meta.json").read_text())
    report = _run_json(capsys, DEMO_DP)
    assert [s["rank"] for s in report["files"]] == list(range(meta["world_size"]))
    for r, stats in enumerate(report["files"]):
        _check_against_trace(stats, DEMO_DP / f"rank-{r}.et.json.gz", 10)
        # every parameter is found, and DDP all-reduces every gradient once
        assert stats["params"]["bytes"] == 4 * meta["num_params"]
        assert sum(row["in_bytes"] for row in stats["collectives"]) == 4 * meta["num_params"]
        assert [row["pg"] for row in stats["collectives"]] == [None]  # gloo names no group
    cross = report["cross_rank"]
    lower = [s["memory"]["lower_bound_bytes"] for s in report["files"]]
    assert cross["num_ranks"] == meta["world_size"] and cross["lower_bound_bytes"] == [min(lower), max(lower)]
    assert cross["param_bytes"] == [4 * meta["num_params"]] * 2


def test_param_named_rank_files(capsys, dlrm_rank_dir):
    report = _run_json(capsys, dlrm_rank_dir, "--top", 3)
    assert [s["rank"] for s in report["files"]] == list(range(8))
    for stats in report["files"][::3]:
        _check_against_trace(stats, Path(stats["path"]), 3)
    ops = [s["num_ops"] for s in report["files"]]
    assert report["cross_rank"]["num_ops"] == [min(ops), max(ops)]
    assert report["cross_rank"]["num_collective_calls"] == [8, 8]  # 5 all_to_all + 3 all_reduce


def test_multi_rank_archive_reads_like_its_folder(capsys, public_trace_dir, dlrm_rank_dir):
    archive = public_trace_dir / "dlrm_pytorch_et.tar.gz"
    from_archive = _run_json(capsys, archive, "--top", 3)
    from_folder = _run_json(capsys, dlrm_rank_dir, "--top", 3)
    assert [s["rank"] for s in from_archive["files"]] == list(range(8))
    assert from_archive["files"][5]["path"] == f"{archive}:dlrm_pytorch_et/dlrm_eg_5.json"
    for a, b in zip(from_archive["files"], from_folder["files"]):
        assert {k: v for k, v in a.items() if k != "path"} == {k: v for k, v in b.items() if k != "path"}
    assert from_archive["cross_rank"] == from_folder["cross_rank"]


def test_one_trace_archive_is_one_file(capsys, public_trace_dir):
    report = _run_json(capsys, public_trace_dir / "resnet_1gpu_et.json.tar.gz", "--top", 2)
    (stats,) = report["files"]
    assert report["cross_rank"] is None and stats["rank"] is None and stats["num_nodes"] == 14392


def test_a_subset_of_ranks_is_inspected_as_is(capsys, tmp_path):
    report = _run_json(capsys, _gap_folder(tmp_path), "--top", 1)
    assert [s["rank"] for s in report["files"]] == [0, 2] and report["cross_rank"]["num_ranks"] == 2


def test_human_tables(capsys):
    assert main([str(DEMO_DP), "--top", "3"]) == 0
    out = capsys.readouterr().out
    trace = load_trace(DEMO_DP / "rank-2.et.json.gz")
    for name, _ in Counter(op.name for op in trace.ops).most_common(3):
        assert name in out
    assert all(f"rank-{r}.et.json.gz" in out for r in range(4))
    assert "across ranks" in out and "4 ranks" in out and "all_reduce" in out
    assert "(not recorded)" in out and "default_pg" in out


def test_console_script_json(tmp_path):
    """The installed entry point (or ``python -m``), gzip and plain files alike."""
    plain = tmp_path / "rank-0.json"
    plain.write_bytes(gzip.decompress((DEMO_DP / "rank-0.et.json.gz").read_bytes()))
    script = shutil.which("tracefleet-inspect", path=str(Path(sys.executable).parent))
    cmd = [script] if script else [sys.executable, "-m", "orchestrator.cli.inspect"]
    proc = subprocess.run([*cmd, str(plain), "--json", "--top", "2"], capture_output=True, text=True,
                          timeout=120, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr
    (stats,) = json.loads(proc.stdout)["files"]
    _check_against_trace(stats, plain, 2)


# ---------------------------------------------------------------- errors: one line, exit 2

def _cut_trace(tmp_path) -> Path:
    data = gzip.decompress((DEMO_DP / "rank-0.et.json.gz").read_bytes())
    path = tmp_path / "rank-0.et.json"
    path.write_bytes(data[:len(data) // 3])
    return path


@pytest.mark.parametrize("case", ["missing", "empty_folder", "truncated", "over_limit", "negative_top"])
def test_user_errors_exit_2_without_traceback(capsys, tmp_path, case):
    args, named = {
        "missing": lambda: ([str(tmp_path / "nowhere")], "nowhere"),
        "empty_folder": lambda: ([str(tmp_path)], str(tmp_path)),
        "truncated": lambda: ([str(_cut_trace(tmp_path))], "rank-0.et.json"),
        "over_limit": lambda: ([str(DEMO_DP), "--max-decompressed-bytes", "64KiB"],
                               "expands past the limit of 65,536 bytes"),
        "negative_top": lambda: ([str(DEMO_DP), "--top", "-1"], "--top"),
    }[case]()
    assert main(args) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tracefleet-inspect: error: ") and named in lines[0]
    assert "Traceback" not in captured.err


def _gap_folder(tmp_path) -> Path:
    for r in (0, 2):
        shutil.copy(DEMO_DP / f"rank-{r}.et.json.gz", tmp_path / f"rank-{r}.et.json.gz")
    return tmp_path


def test_debug_shows_the_traceback(capsys, tmp_path):
    assert main([str(_cut_trace(tmp_path)), "--debug"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and "TraceError" in err and "truncated JSON" in err


def test_error_in_a_subprocess(tmp_path):
    path = _cut_trace(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "orchestrator.cli.inspect", str(path)],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith(f"tracefleet-inspect: error: {path}: truncated JSON")
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr


def _nested_tensor_node(nodes: list) -> dict:
    """A node inside an aten op (the replay never reads its arguments) with a tensor input."""
    by_id = {n["id"]: n for n in nodes}
    return next(n for n in nodes if by_id.get(n["ctrl_deps"], {}).get("name", "").startswith("aten::")
                and n["inputs"]["types"] and n["inputs"]["types"][0].startswith("Tensor("))


@pytest.mark.parametrize("damage, message", [
    (lambda n: n["inputs"]["shapes"].__setitem__(0, [-3, 2]), "shape"),
    (lambda n: n["inputs"]["types"].__setitem__(0, 17), "type #0 is 17"),
    (lambda n: n["inputs"]["values"].pop(), "different lengths"),
])
def test_implausible_nested_nodes_are_named_and_strict_refuses(capsys, tmp_path, damage, message):
    """A damaged node the replay does not read changes nothing it does (it loads the same),
    so it used to pass without a word: inspect names it, --strict refuses the trace."""
    doc = read_json(DEMO_DP / "rank-0.et.json.gz")
    node = _nested_tensor_node(doc["nodes"])
    damage(node)
    path = tmp_path / "rank-0.et.json"
    path.write_text(json.dumps(doc))
    assert len(load_trace(path).ops) == len(load_trace(DEMO_DP / "rank-0.et.json.gz").ops)
    report = _run_json(capsys, path)
    bad = report["files"][0]["implausible_nodes"]
    assert bad["num_nodes"] == 1 and bad["examples"][0].startswith(f"node {node['id']} ")
    assert message in bad["examples"][0]
    assert main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "warning: 1 node(s) hold arguments the replay would refuse" in out
    assert f"node {node['id']} ({node['name']})" in out
    assert main([str(path), "--strict"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"tracefleet-inspect: error: {path}: --strict: 1 ")
    assert main([str(DEMO_DP), "--strict"]) == 0  # an undamaged capture: no warning
    assert "warning" not in capsys.readouterr().out
