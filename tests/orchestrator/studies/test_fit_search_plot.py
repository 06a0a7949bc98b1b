"""The fit_search plot stays readable (orchestrator/studies/fit_search_report.py): a bisection's
last probes lie pixels apart, so their labels must not be written over one another, and the
title must lie inside the figure beside the legend."""
from __future__ import annotations

import pytest

from orchestrator.studies import fit_search_report
from orchestrator.studies.fit_search_report import plot_axis

GIB = 2**30


def _probe(value, reserved_gib, verdict):
    return {"value": value, "verdict": verdict, "error_band": 0.1,
            "predicted_reserved_peak_bytes": int(reserved_gib * GIB),
            "predicted_allocated_peak_bytes": int(reserved_gib * 0.9 * GIB),
            "usable_capacity_bytes": 76 * GIB}


# a seq_len search as fit_search probes it: a gallop, then a bisection down to a few tokens
SEQ_LEN = [_probe(1024, 20, "fits"), _probe(2048, 30, "fits"), _probe(4096, 50, "fits"),
           _probe(8192, 80, "oom"), _probe(6144, 65, "fits"), _probe(7168, 72, "too_close"),
           _probe(6656, 68, "fits"), _probe(6912, 70, "fits"), _probe(6784, 69, "fits")]
AC = [_probe("none", 90, "oom"), _probe("selective_op", 70, "fits"), _probe("full", 40, "fits")]


@pytest.fixture
def drawn(monkeypatch, tmp_path):
    figures = []
    monkeypatch.setattr(fit_search_report, "save_png", lambda fig, path: figures.append(fig))

    def draw(axis, probes, keep=()):
        assert plot_axis(axis, probes, tmp_path / "plot.png", keep=keep)
        fig = figures.pop()
        fig.draw_without_rendering()
        return fig, fig.axes[0]
    return draw


def test_crowded_probe_labels_do_not_overlap_and_the_answer_keeps_its_label(drawn):
    fig, ax = drawn("seq_len", SEQ_LEN, keep=(6912, 7168))  # the search's answer
    labels = [t for t in ax.get_xticklabels() if t.get_text()]
    boxes = [t.get_window_extent() for t in labels]
    assert all(not a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:])
    texts = {t.get_text() for t in labels}
    assert "6912" in texts  # the best value that fits
    assert {"1024", "8192"} <= texts
    # every probe keeps its tick, labelled or not
    assert sorted(ax.get_xticks()) == sorted(p["value"] for p in SEQ_LEN)


@pytest.mark.parametrize("axis,probes", [("activation_checkpointing", AC), ("seq_len", SEQ_LEN)])
def test_the_title_lies_inside_the_figure(drawn, axis, probes):
    fig, ax = drawn(axis, probes)
    title = ax.title.get_window_extent()
    assert title.x0 >= 0 and title.x1 <= fig.bbox.width
    assert title.y1 <= fig.bbox.height
