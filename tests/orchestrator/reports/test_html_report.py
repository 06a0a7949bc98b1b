"""`tracefleet-report`: PNGs and one self-contained HTML page, checked as a browser shows it."""
from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import orjson
import pytest

from orchestrator.outputs import REPORT_HTML, REPORT_PLOTS_DIR
from orchestrator.reports.html_report import map_axes, write_report
from orchestrator.cli.report import main as report_main
from orchestrator.results import ResultsStore, make_row, point_key
from tests.support.browser import chromium, require_browser

MiB = 1 << 20


def _rank(r, status="ok"):
    timeline = [[i, (2 + (i % 7) + r) * MiB] for i in range(0, 200, 5)]
    return {"rank": r, "status": status, "node_ip": "10.0.0.1", "iteration_time_s": 0.05 + r / 100,
            "iteration_times_s": [0.05, 0.051, 0.052], "accounted_peak_bytes": 10 * MiB,
            "peak_memory_bytes": 10 * MiB, "liveness_lower_bound_bytes": 6 * MiB,
            "num_flushes": 2, "coverage": 1.0, "memory_timeline": timeline, "flush_ticks": [40, 120]}


def _summary(status="ok", **extra):
    return {"status": status, "world_size": 2, "error": None if status == "ok" else "rank 1 oom at node 9",
            "iteration_time_s": 0.06, "iteration_time_median_s": 0.055,
            "measured_peak_bytes": 11 * MiB, "accounted_peak_bytes": 10 * MiB,
            "peak_memory_bytes": 11 * MiB, "peak_memory_source": "measured",
            "liveness_lower_bound_bytes": 6 * MiB, "device_memory_capacity_bytes": 16 * MiB,
            "device_memory_threshold": 0.5, "num_flushes": 4, "coverage": 1.0,
            "mode": "full", "allocation_mode": "lazy", "ranks": [_rank(0), _rank(1)], **extra}


def _run_dir(path: Path, **extra) -> Path:
    path.mkdir(parents=True)
    (path / "summary.json").write_bytes(orjson.dumps(_summary(**extra)))
    return path


@pytest.fixture
def sweep_root(tmp_path):
    """A sweep over capacity x mode x threshold with OOM points, ZeRO-3 figures and run dirs,
    plus a minimum-memory search's rows."""
    root = tmp_path / "sweep"
    store = ResultsStore(root)
    num = 0
    for mode in ("lazy", "faithful"):
        for cap in ("8MiB", "16MiB"):
            for t in (1.0, 0.5, 0.25):
                overrides = [f"replay.allocation.mode={mode}", f"replay.device_memory_capacity={cap}",
                             f"replay.allocation.device_memory_threshold={t}"]
                status = "oom" if cap == "8MiB" and t == 1.0 else "ok"
                _run_dir(root / str(num), status=status)
                store.put(make_row("point", point_key(overrides), overrides, status,
                                   None if status == "ok" else "rank 1 oom", str(num), {
                                       "allocation_mode": mode, "device_memory_threshold": t,
                                       "device_memory_capacity_bytes": int(cap[:-3]) * MiB,
                                       "peak_memory_bytes": int(t * 12 * MiB) + num,
                                       "iteration_time_s": 0.05 / t,
                                       "zero3_strategy": "per_param" if mode == "lazy" else "leaf_coalesced",
                                       "zero3_num_allgathers_per_iteration": 138 if mode == "lazy" else 10,
                                       "zero3_fetch_host_s": 0.02, "zero3_release_host_s": 0.01}))
                num += 1
    for cap, status in ((None, "ok"), (16 * MiB, "ok"), (6 * MiB, "oom"), (11 * MiB, "ok"), (8 * MiB, "oom")):
        overrides = ["replay.allocation.mode=lazy", "replay.allocation.device_memory_threshold=1.0",
                     f"replay.device_memory_capacity={cap}"]
        store.put(make_row("probe", "probe " + point_key(overrides), overrides, status, None, None,
                           {"device_memory_capacity_bytes": cap}))
    axes = ["replay.allocation.mode=lazy", "replay.allocation.device_memory_threshold=1.0"]
    store.put(make_row("min_memory", "min_memory " + point_key(axes), axes, "ok", None, None,
                       min_capacity_bytes=11 * MiB, max_failing_capacity_bytes=8 * MiB, num_steps=5))
    return root


def _images(page: Path) -> list[str]:
    return re.findall(r"<img [^>]*src='([^']*)'", page.read_text())


def _check_self_contained(page: Path):
    text = page.read_text()
    srcs = _images(page)
    assert srcs and all(s.startswith("data:image/png;base64,") for s in srcs)
    assert not re.search(r"(?:src|href)=['\"]?(?:https?:|//|file:)", text)
    assert "<script" not in text
    pngs = sorted((page.parent / REPORT_PLOTS_DIR).glob("*.png"))
    assert pngs and all(p.stat().st_size > 1000 for p in pngs)
    embedded = {base64.b64decode(s.split(",", 1)[1]) for s in srcs}
    assert embedded == {p.read_bytes() for p in pngs}  # each PNG written is the one shown
    return pngs


def test_run_report_embeds_its_plots(tmp_path):
    run = _run_dir(tmp_path / "run")
    page = write_report(run)
    pngs = _check_self_contained(page)
    assert {p.name for p in pngs} == {"memory_timeline.png", "iteration_times.png"}
    text = page.read_text()
    assert "peak memory, measured" in text and "11.0 MiB" in text


def test_run_report_reads_timelines_from_the_memory_csvs(tmp_path):
    run = _run_dir(tmp_path / "run")
    summary = orjson.loads((run / "summary.json").read_bytes())
    for rank in summary["ranks"]:  # what report.write_run_outputs leaves: timelines in CSVs
        timeline = rank.pop("memory_timeline")
        (run / "memory").mkdir(exist_ok=True)
        (run / "memory" / f"rank-{rank['rank']}.csv").write_text(
            "op_index,bytes\n" + "".join(f"{o},{b}\n" for o, b in timeline))
    (run / "summary.json").write_bytes(orjson.dumps(summary))
    write_report(run)
    assert (run / REPORT_PLOTS_DIR / "memory_timeline.png").stat().st_size > 1000


def test_sweep_report_has_every_plot(sweep_root):
    page = write_report(sweep_root)
    names = {p.name for p in _check_self_contained(page)}
    assert {"threshold_sweep.png", "status_map.png", "min_memory.png", "zero3.png"} <= names
    assert sum(n.startswith("timeline_") for n in names) == 12
    text = page.read_text()
    assert "Minimum memory" in text and "11.0 MiB" in text


def test_status_map_axes_prefer_capacity_by_mode(sweep_root):
    frame = ResultsStore(sweep_root).frame()
    points = frame[frame["kind"] == "point"]
    assert map_axes(points) == ("replay.device_memory_capacity", "replay.allocation.mode")
    one = points[points["replay.allocation.mode"] == "lazy"]
    assert map_axes(one) == ("replay.device_memory_capacity", "replay.allocation.device_memory_threshold")


def test_report_cli_exit_codes(sweep_root, tmp_path, capsys):
    assert report_main([str(sweep_root)]) == 0
    assert str(sweep_root / REPORT_HTML) in capsys.readouterr().out
    assert report_main([str(tmp_path / "missing")]) == 2
    (tmp_path / "empty").mkdir()
    assert report_main([str(tmp_path / "empty")]) == 2
    assert "no results table" in capsys.readouterr().err


def test_a_cut_summary_or_row_is_named_never_a_traceback(sweep_root, tmp_path, capsys, caplog):
    run = _run_dir(tmp_path / "run")
    (run / "summary.json").write_bytes((run / "summary.json").read_bytes()[:60])
    assert report_main([str(run)]) == 2
    err = capsys.readouterr().err
    (line,) = err.strip().splitlines()
    assert line.startswith(f"tracefleet-report: error: {run / 'summary.json'}: a run summary "
                           "that is not valid JSON (cut short: unexpected end of data")
    # a sweep root: the bad row and a point's cut summary are named and left out; page written
    bad_row = next(p for p in sorted((sweep_root / "rows").glob("*.json"))
                   if orjson.loads(p.read_bytes())["run_dir"] == "1")
    bad_row.write_bytes(bad_row.read_bytes()[:30])
    point_summary = sweep_root / "0" / "summary.json"  # point 0's row stays whole
    point_summary.write_bytes(b"{")
    with caplog.at_level("WARNING", logger="tracefleet"):
        assert report_main([str(sweep_root)]) == 0
    assert f"skipped {bad_row}: a results row that is not valid JSON" in caplog.text
    assert f"{point_summary}: a run summary that is not valid JSON" in caplog.text
    assert (sweep_root / REPORT_HTML).is_file()


# --- as a browser shows it ---------------------------------------------------------------------
_PROBE = """<script>window.addEventListener('load', () => {
  const out = document.createElement('pre'); out.id = 'img-probe';
  out.textContent = JSON.stringify([...document.images].map(i => [i.complete, i.naturalWidth, i.naturalHeight]));
  document.body.appendChild(out);});</script>"""


@pytest.fixture
def browser():
    """The browser's path (tests/support/browser.py: skips without one, fails under CI=true)."""
    return require_browser()


def _image_sizes(page: Path, tmp_path: Path) -> list[list]:
    """[complete, naturalWidth, naturalHeight] of every <img>, read through the DOM of a copy
    of the page with a probe script added (the report itself has no script)."""
    probe = tmp_path / "probe.html"
    probe.write_text(page.read_text().replace("</body>", _PROBE + "</body>"))
    proc = chromium(tmp_path, "--virtual-time-budget=5000", "--dump-dom", probe.as_uri())
    m = re.search(r'<pre id="img-probe">(.*?)</pre>', proc.stdout, re.S)
    assert m, f"no probe output; chromium said: {proc.stderr[-1500:]}"
    return json.loads(m.group(1))


def test_report_renders_in_headlesschromium(browser, sweep_root, tmp_path):
    from PIL import Image

    page = write_report(sweep_root)
    sizes = _image_sizes(page, tmp_path)
    assert len(sizes) == len(_images(page))
    assert all(complete and width > 100 and height > 100 for complete, width, height in sizes), sizes
    shot = tmp_path / "shot.png"
    proc = chromium(tmp_path, "--window-size=1280,2400", f"--screenshot={shot}", page.as_uri())
    assert shot.is_file(), proc.stderr[-1500:]
    image = Image.open(shot).convert("RGB")
    # the first plot sits under the title and the counts line: its region is not blank, and
    # shows the plot's colors (a broken image is an icon on white)
    region = image.crop((20, 150, 900, 560))
    colors = region.getcolors(maxcolors=1 << 20) or []
    non_white = sum(n for n, c in colors if sum(c) < 720)
    assert non_white > 0.05 * region.width * region.height
    assert len(colors) > 50


def test_the_browser_check_sees_a_broken_image(browser, tmp_path):
    page = tmp_path / "broken.html"
    page.write_text("<!DOCTYPE html><html><body><img src='data:image/png;base64,AAAA'></body></html>")
    assert _image_sizes(page, tmp_path) == [[True, 0, 0]]
