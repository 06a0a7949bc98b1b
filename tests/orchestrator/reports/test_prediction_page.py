"""``prediction.html`` (orchestrator/reports/prediction_page.py) beside ``prediction.json``: the
timeline it plots is the allocator model's, the page is self-contained, and headless Chromium
shows its plots."""
from __future__ import annotations

import base64
import json
import re

import pytest
from matplotlib.figure import Figure

from actors.replay.memory.predicted_timeline import MAX_POINTS, SERIES
from orchestrator.cli.predict import predict_config
from orchestrator.config import DEMO_TRACES
from orchestrator.outputs import PREDICTION_HTML, PREDICTION_PLOTS_DIR
from orchestrator.reports.prediction_page import write_prediction_page
from orchestrator.studies.predict import predict
from tests.support.browser import chromium, dom_after_scripts, require_browser

_PROBE = """<script>window.addEventListener('load', () => {
  const out = document.createElement('pre'); out.id = 'img-probe';
  out.textContent = JSON.stringify([...document.images].map(i => [i.complete, i.naturalWidth]));
  document.body.appendChild(out);});</script>"""


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """tracefleet-predict on the demo traces (4 ranks) with the snapshots on."""
    out = tmp_path_factory.mktemp("prediction")
    cfg = predict_config(f"trace.dir={DEMO_TRACES / 'gpt_dp_4'}", "target=a100_40gb",
                         "predict.snapshot=true")
    return out, predict(cfg, out)


def _images(text: str) -> list[str]:
    return re.findall(r"<img [^>]*src='([^']*)'", text)


def test_the_timeline_is_the_allocator_models(run):
    out, p = run
    t = json.loads((out / "prediction.json").read_text())["memory_timeline"]
    assert t["measured"] and t["iteration"] == 2 and 10 < len(t["points"]) <= MAX_POINTS
    cols = t["columns"]
    for pt in t["points"]:
        # the categories stack up to the allocated line; reserved is above it
        assert sum(pt[cols.index(s)] for s in SERIES) == pt[1] <= pt[2]
    assert t["reserved_peak"]["bytes"] == p.predicted_reserved_peak_bytes == \
        max(pt[2] for pt in t["points"])  # the peak is in the measured iteration here
    assert t["allocated_peak"]["bytes"] == p.predicted_allocated_peak_bytes
    assert sum(t["reserved_peak"]["by_stream"].values()) == t["reserved_peak"]["bytes"]
    assert [pt[0] for pt in t["points"]] == sorted(pt[0] for pt in t["points"])
    # one snapshot per distinct rank trace, named in the prediction
    assert p.snapshots == {r: f"snapshot_rank{r}.pickle" for r in p.snapshots}
    assert len(p.snapshots) == p.num_distinct_traces
    assert all((out / name).stat().st_size > 1000 for name in p.snapshots.values())
    assert p.timings_s["snapshot_s"] > 0


def test_the_page_is_self_contained(run):
    out, p = run
    text = (out / PREDICTION_HTML).read_text()
    srcs = _images(text)
    pngs = sorted((out / PREDICTION_PLOTS_DIR).glob("*.png"))
    assert {x.name for x in pngs} == {"memory.png", "streams.png"}
    assert {base64.b64decode(s.split(",", 1)[1]) for s in srcs} == {x.read_bytes() for x in pngs}
    assert "<script" not in text and not re.search(r"(?:src|href)=['\"]?(?:https?:|//|file:)",
                                                   text)
    assert f">{p.verdict}</span>" in text and "error band 3%" in text
    assert "Reserved at the peak, by stream" in text and "snapshot_rank0.pickle" in text


def test_extra_plots_and_a_prediction_without_a_timeline(run, tmp_path):
    _, p = run
    fig = Figure(figsize=(4, 3))
    fig.add_subplot().plot([0, 1], [1, 0])
    fig.savefig(tmp_path / "fit_search_batch_size.png")
    page = write_prediction_page(tmp_path, p.to_dict(), [("fit_search: batch_size",
                                                          tmp_path / "fit_search_batch_size.png")])
    text = page.read_text()
    assert len(_images(text)) == 3 and "<h2>fit_search: batch_size</h2>" in text
    bare = write_prediction_page(tmp_path / "bare", {**p.to_dict(), "memory_timeline": None})
    bare = bare.read_text()
    assert not _images(bare) and "No memory timeline" in bare


def test_the_page_renders_in_headless_chromium(run, tmp_path):
    require_browser()
    from PIL import Image

    out, _ = run
    probe = tmp_path / "probe.html"
    probe.write_text((out / PREDICTION_HTML).read_text().replace("</body>", _PROBE + "</body>"))
    m = re.search(r'<pre id="img-probe">(.*?)</pre>', dom_after_scripts(probe, tmp_path), re.S)
    assert m, "no probe output"
    sizes = json.loads(m.group(1))
    assert len(sizes) == 2 and all(done and width > 300 for done, width in sizes), sizes
    shot = tmp_path / "shot.png"
    proc = chromium(tmp_path, "--window-size=1280,1600", f"--screenshot={shot}",
                    (out / PREDICTION_HTML).as_uri())
    assert shot.is_file(), proc.stderr[-1500:]
    # the memory plot sits below the figures table: colored, not blank
    region = Image.open(shot).convert("RGB").crop((30, 600, 1000, 1000))
    colors = region.getcolors(maxcolors=1 << 20) or []
    assert sum(n for n, c in colors if sum(c) < 600) > 0.05 * region.width * region.height
    assert len(colors) > 50


def test_the_cublas_workspace_is_said_where_the_peak_is(run):
    """The allocated peak holds the target's cuBLAS workspace (served first, kept all run);
    the breakdown is of the trace's tensors, so the table and page name it beside the peak."""
    from orchestrator.reports.predict_table import prediction_table

    out, p = run
    workspace = p.target["cublas_workspace_bytes"]
    assert workspace > 0 and p.predicted_allocated_peak_bytes >= workspace
    table = prediction_table(p.to_dict())
    rows = table.splitlines()
    at = next(i for i, line in enumerate(rows) if line.startswith("| allocated peak* |"))
    assert rows[at + 1].startswith("| of which cuBLAS workspace* | ") and \
        "not in the breakdown" in rows[at + 1]
    assert "of which cuBLAS workspace*" in (out / PREDICTION_HTML).read_text()


def test_the_allocated_peaks_stack_is_recorded_whole(run):
    _, p = run
    peak = p.memory_timeline["allocated_peak"]
    assert sum(peak["by_series"].values()) == peak["bytes"] == p.predicted_allocated_peak_bytes
    assert set(peak["by_series"]) <= set(SERIES) and all(peak["by_series"].values())


def test_a_one_op_peak_still_shows_its_stack(monkeypatch, tmp_path):
    """A peak held for one op of thousands is narrower than a pixel on the timeline: the bar
    beside it stacks the peak's categories to the peak."""
    from orchestrator.reports import prediction_page

    cols = ["op_index", "allocated_bytes", "reserved_bytes", *SERIES]
    mib = 2**20

    def point(op, params, acts):
        row = dict.fromkeys(SERIES, 0) | {"parameters": params, "activations": acts}
        return [op, params + acts, 2 * (params + acts), *(row[s] for s in SERIES)]
    points = [point(i, 100 * mib, 10 * mib) for i in range(0, 5000, 10)]
    points[250] = point(2500, 100 * mib, 900 * mib)  # one op: 9x the activations
    peak = {"bytes": 1000 * mib, "iteration": 2, "op_index": 2500,
            "by_series": {"parameters": 100 * mib, "activations": 900 * mib}}
    p = {"memory_timeline": {"columns": cols, "points": points, "series": list(SERIES),
                             "iteration": 2, "measured": True, "ops_per_point": 10,
                             "reserved_peak": None, "allocated_peak": peak},
         "usable_capacity_bytes": 4000 * mib, "predicted_reserved_peak_bytes": 2000 * mib,
         "error_band": 0.1, "verdict": "fits"}
    figures = []
    monkeypatch.setattr(prediction_page, "save_png", lambda fig, path: figures.append(fig))
    prediction_page.plot_memory(p, tmp_path / "memory.png")
    bar = figures[0].axes[1]
    heights = {patch.get_facecolor()[:3]: patch.get_height() for patch in bar.patches}
    scale = 1000 * mib / sum(heights.values())  # the plot's unit, whatever it picked
    assert sorted(h * scale for h in heights.values()) == \
        pytest.approx(sorted(peak["by_series"].values()))
    assert "op 2500" in bar.get_title()


def test_a_peak_outside_the_plotted_iteration_is_said_to_be_elsewhere():
    from orchestrator.reports.prediction_page import _caption

    timeline = {"iteration": 2, "measured": True, "ops_per_point": 3,
                "reserved_peak": {"bytes": 3 * 2**30, "iteration": 1, "op_index": 40}}
    assert "op 40 of iteration 1, not the iteration plotted" in _caption(timeline)
    same = {**timeline, "reserved_peak": {**timeline["reserved_peak"], "iteration": 2}}
    assert "op 40 of iteration 2." in _caption(same) and "not the" not in _caption(same)
