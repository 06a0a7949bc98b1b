"""Predicted memory snapshots (actors/replay/memory/snapshot.py, allocator_events.py): torch's
``_snapshot()`` layout, read by ``torch.cuda._memory_viz``'s own functions and by the viewer's
page in headless Chromium, consistent with the allocator model's figures."""
from __future__ import annotations

import base64
import html
import json
import pickle
import re
from types import SimpleNamespace

import pytest
import torch.cuda._memory_viz as memory_viz

from actors.replay.config import AllocationConfig, ReplayConfig
from actors.replay.engine import ReplayEngine
from actors.replay.memory.allocator_events import RecordingAllocatorModel
from actors.replay.memory.cuda_alloc_conf import AllocatorSettings
from actors.replay.memory.model_recording import RecordingReservedModel, pop_snapshot
from actors.replay.memory.reserved_model import ReservedMemoryModel
from actors.replay.memory.snapshot import FrameTable, build_snapshot
from actors.replay.memory.target import CudaAllocatorConfig, TargetConfig
from actors.trace import load_trace
from orchestrator.config import DEMO_TRACES
from tests.support.browser import dom_after_scripts, probe_text, require_browser
from tests.support.memory_viz import memory_viz_page, opcodes_outside_the_viewer, replay_history

MiB = 1 << 20
DEMO = DEMO_TRACES / "gpt_dp_4" / "rank-0.et.json.gz"


def _dry_run(target: TargetConfig, snapshot=True, timeline=False) -> tuple[dict, bytes | None]:
    cfg = ReplayConfig(mode="compute", device="meta", warmup_iters=1, iters=1,
                       measure_memory=False, allocation=AllocationConfig(mode="faithful"),
                       allocator_snapshot=snapshot, allocator_timeline=timeline)
    engine = ReplayEngine(load_trace(DEMO), cfg, target=target)
    try:
        report = engine.run().to_dict()
    finally:
        engine.close()
    return report, pop_snapshot(report)


@pytest.fixture(scope="module")
def demo():
    """The demo trace's rank 0 on a100_40gb: its report and its snapshot."""
    report, data = _dry_run(TargetConfig(name="a100_40gb"))
    return report, data, pickle.loads(data)


def test_the_snapshot_is_torchs_layout_from_the_models_own_state(demo):
    report, data, snap = demo
    assert set(snap) >= {"segments", "device_traces"} and len(snap["device_traces"]) == 1
    seg = snap["segments"][0]
    assert {"device", "address", "total_size", "stream", "blocks", "segment_type"} <= set(seg)
    assert {"size", "requested_size", "state", "frames"} <= set(seg["blocks"][0])
    # the history ends exactly in the segments, and its peaks are the model's
    replayed = replay_history(snap)
    assert replayed["peak_reserved"] == report["predicted_reserved_peak_bytes"]
    assert replayed["reserved"] == report["cuda_allocator"]["reserved_bytes"]
    assert replayed["counts"]["alloc"] == report["cuda_allocator"]["num_allocs"]
    assert replayed["counts"]["segment_alloc"] == report["cuda_allocator"]["num_segment_allocs"]
    # the allocated peak counts whole blocks; the history records the requested bytes
    assert replayed["peak_allocated"] <= report["predicted_allocated_peak_bytes"] \
        < replayed["peak_allocated"] + replayed["counts"]["alloc"] * 512
    # frames: the op (node id and name), its range, the iteration; one list per (iteration, op)
    allocs = [e for e in snap["device_traces"][0] if e["action"] == "alloc"]
    # the cuBLAS workspace first, then the state held from before the iteration, then ops
    before = [e for e in allocs if e["frames"][0]["name"] == "held before the first op"]
    assert allocs[0] is before[0] and allocs[0]["size"] == report["cuda_allocator"]["target"][
        "cublas_workspace_bytes"] and {e["category"] for e in before[1:]} >= {"parameters"}
    op_frames = [e["frames"] for e in allocs if e not in before]
    assert all(f[0]["filename"] == "node" and f[0]["name"].startswith(("aten::", "c10d::"))
               and f[-1]["filename"] == "iteration" for f in op_frames)
    assert {f[-1]["name"] for f in op_frames} == {"warm-up", "measured"}
    assert any(f[1]["name"].startswith("## module:") for f in op_frames if len(f) > 2)
    assert len({id(f) for f in op_frames}) < len(op_frames)  # shared, so the pickle is small
    assert {e["category"] for e in allocs} >= {"parameters", "activations", "unknown"}


def test_memory_vizs_own_functions_read_it(demo):
    _, data, snap = demo
    # segsum asserts that every segment's blocks add up and so does the total
    summary = memory_viz.segsum(snap)
    assert f"segments: {len(snap['segments'])}" in summary
    history = memory_viz.trace(snap)
    assert f"{len(snap['device_traces'][0])} entries" in history and "cudaMalloc(" in history
    # the flamegraphs' input lines (the flamegraph.pl step is the identity here): the frames
    # outermost first, the op innermost; live at the end: the state held from before and
    # the optimizer state the warm-up's first step made
    lines = memory_viz.segments(snap, format_flamegraph=lambda text: text)
    assert re.search(r"active_allocated;iteration:1:warm-up;range:0:Optimizer\.step[^;]*;"
                     r"node:\d+:aten::\w+ \d+\n", lines)
    assert "active_allocated;replay:0:held before the first op" in lines
    assert memory_viz.memory(snap, format_flamegraph=lambda text: text).strip()
    for page in (memory_viz.trace_plot(snap), memory_viz.segment_plot(snap)):
        files = json.loads(re.search(r"const local_files = (\[.*?\])\n", page).group(1))
        assert pickle.loads(base64.b64decode(files[0]["base64"])) == snap
    # the viewer's unpickler reads protocols 2-4 and no other type
    assert opcodes_outside_the_viewer(data) == set()
    assert opcodes_outside_the_viewer(pickle.dumps(snap, protocol=5)) == {"PROTO 5"}


def test_the_viewers_page_reads_it_in_headless_chromium(demo, tmp_path):
    require_browser()
    _, _, snap = demo
    replayed = replay_history(snap)
    for view, page in (("Active Memory Timeline", memory_viz.trace_plot(snap)),
                       ("Allocator State History", memory_viz.segment_plot(snap))):
        path = tmp_path / f"{view.split()[0]}.html"
        path.write_text(memory_viz_page(page))
        found = probe_text(dom_after_scripts(path, tmp_path), "viewer-probe")
        assert found is not None, f"the page ran no viewer ({view})"
        probe = json.loads(html.unescape(found))
        assert probe["errors"] == [] and probe["view"] == view
        assert probe["num_segments"] == len(snap["segments"])
        assert probe["num_events"] == len(snap["device_traces"][0])
        # walked back from the final state, the history starts on an empty device
        assert probe["start_blocks"] == 0 and probe["start_reserved"] == 0
        assert probe["peak_allocated"] == replayed["peak_allocated"]
        assert "unknown" in probe["categories"]


def test_the_page_check_sees_a_snapshot_the_viewer_could_not_walk(demo, tmp_path):
    require_browser()
    _, _, snap = demo
    broken = {**snap, "device_traces": [snap["device_traces"][0][5:]]}  # the first events lost
    path = tmp_path / "broken.html"
    path.write_text(memory_viz_page(memory_viz.trace_plot(broken)))
    probe = json.loads(html.unescape(probe_text(dom_after_scripts(path, tmp_path),
                                                "viewer-probe")))
    assert probe["start_reserved"] != 0 or probe["start_blocks"] != 0 or probe["errors"]


def test_an_out_of_memory_and_expandable_segments(tmp_path):
    small = TargetConfig(name="custom", device_memory="24MiB", cuda_context="0", nccl_num_peers=0)
    report, data = _dry_run(small)
    snap = pickle.loads(data)
    ooms = [e for e in snap["device_traces"][0] if e["action"] == "oom"]
    assert report["num_predicted_ooms"] == len(ooms) > 0
    assert ooms[0]["device_free"] >= 0 and "addr" not in ooms[0]
    replay_history(snap)  # the forced segments after each OOM are in the history too
    memory_viz.segsum(snap)
    expandable = TargetConfig(name="a100_40gb", allocator=CudaAllocatorConfig(
        pytorch_cuda_alloc_conf="expandable_segments:True"))
    report, data = _dry_run(expandable)
    snap = pickle.loads(data)
    actions = {e["action"] for e in snap["device_traces"][0]}
    assert "segment_map" in actions and "segment_alloc" not in actions
    assert all(s["is_expandable"] for s in snap["segments"])
    assert replay_history(snap)["peak_reserved"] == report["predicted_reserved_peak_bytes"]
    memory_viz.segsum(snap)


def test_a_hand_worked_history():
    model = RecordingAllocatorModel(AllocatorSettings(), 64 * MiB, 64 * MiB)
    a = model.malloc(1000)  # small pool: a 2 MiB segment, a 1024 B block
    model.tag = 7
    b = model.malloc(3 * MiB)  # large pool: a 20 MiB segment
    model.free(a)
    model.release_cached()  # the small segment is whole again: given back
    assert [e[:3] for e in model.events] == [
        (3, a.addr, 2 * MiB), (0, a.addr, 1000), (3, b.addr, 20 * MiB), (0, b.addr, 3 * MiB),
        (1, a.addr, 1000), (2, a.addr, 1000), (4, a.addr, 2 * MiB)]
    assert model.stream_reserved == {0: 20 * MiB} and model.events[3][4] == 7
    ops = [SimpleNamespace(node_id=100 + i, name="aten::mm", module="## module:layers.0.attn ##")
           for i in range(8)]
    snap = build_snapshot(model, FrameTable(ops, 1))
    assert [(s["address"], s["total_size"]) for s in snap["segments"]] == [(b.addr, 20 * MiB)]
    blocks = snap["segments"][0]["blocks"]
    assert [(x["state"], x["size"], x["requested_size"]) for x in blocks] == \
        [("active_allocated", 3 * MiB, 3 * MiB), ("inactive", 17 * MiB, 0)]
    # tag 7: op 7 of the first (warm-up) iteration, inside layers.0.attn's forward range
    assert [memory_viz._frame_fmt(f) for f in blocks[0]["frames"]] == [
        "node:107:aten::mm", "range:0:## module:layers.0.attn ##", "module:0:layers.0",
        "module:0:layers", "iteration:1:warm-up"]
    replay_history(snap)


def test_without_the_flags_the_plain_model_runs():
    cfg = ReplayConfig(mode="compute", device="meta", warmup_iters=0, iters=1,
                       measure_memory=False)
    engine = ReplayEngine(load_trace(DEMO), cfg, target=TargetConfig(name="a100_40gb"))
    try:
        models = [e for e in engine.extensions if isinstance(e, ReservedMemoryModel)]
        assert len(models) == 1 and type(models[0]) is ReservedMemoryModel
        report = engine.run().to_dict()
    finally:
        engine.close()
    assert pop_snapshot(report) is None and "timeline" not in report["cuda_allocator"]
    # the recording model changes no figure
    cfg.allocator_snapshot = cfg.allocator_timeline = True
    engine = ReplayEngine(load_trace(DEMO), cfg, target=TargetConfig(name="a100_40gb"))
    try:
        assert any(isinstance(e, RecordingReservedModel) for e in engine.extensions)
        recorded = engine.run().to_dict()
    finally:
        engine.close()
    for key in ("predicted_reserved_peak_bytes", "predicted_allocated_peak_bytes",
                "num_alloc_retries", "accounted_peak_bytes"):
        assert recorded[key] == report[key], key
