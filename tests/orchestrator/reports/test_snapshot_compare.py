"""Reading snapshots without trusting them (snapshot_file.py) and comparing a recorded one with
a predicted one (snapshot_compare.py): hand-made pairs with a known divergence, the predicted
snapshots of item 1, and pickles that must be refused unread."""
from __future__ import annotations

import os
import pickle

import pytest

from orchestrator.errors import SnapshotError
from orchestrator.reports.snapshot_compare import compare, compare_lines, divergence, peaks
from orchestrator.reports.snapshot_file import loads_snapshot, read_snapshot
from tests.support.snapshots import history

MiB = 1 << 20
STREAM = [(1 * MiB, "embed"), (4 * MiB, "mm"), (2 * MiB, "gelu"), (8 * MiB, "softmax"),
          (3 * MiB, "mm_bwd"), (1 * MiB, "add")]


def test_peaks_and_the_op_at_each():
    p = peaks(history(STREAM))
    assert p.allocated_peak_bytes == 19 * MiB and p.reserved_peak_bytes == 64 * MiB
    assert p.allocated_peak_event["frames"][0]["name"] == "add"
    assert p.reserved_peak_event["frames"][0]["name"] == "first" and p.num_allocs == 6
    # a history recorded from mid-run starts from the final state less what it added
    late = history(STREAM)
    late["device_traces"][0] = late["device_traces"][0][3:]  # the segment and 2 allocs unseen
    assert peaks(late).allocated_peak_bytes == 19 * MiB
    assert peaks(late).reserved_peak_bytes == 64 * MiB


def test_a_hand_made_pair_names_its_first_divergence():
    recorded = history(STREAM)
    # the prediction allocates a workspace first (a GPU makes it at its first matmul) and
    # predicts softmax's 8 MiB as 6 MiB; then the streams agree again
    predicted = history([(32 * MiB, "workspace"), *STREAM[:3], (6 * MiB, "softmax"),
                          *STREAM[4:]], segment=96 * MiB)
    c = compare(recorded, predicted)
    first, lasting = c["first_divergence"], c["lasting_divergence"]
    assert first["recorded"] == {"index": 0, "size": 1 * MiB, "where": "train.py:7:embed"}
    assert first["predicted"]["size"] == 32 * MiB and "workspace" in first["predicted"]["where"]
    assert lasting is None and c["num_realignments"] == 2 and c["num_matched_allocs"] == 5
    assert c["ratio_reserved"] == 1.5
    text = "\n".join(compare_lines(c, "gpu.pickle", "snapshot_rank0.pickle"))
    assert "first divergence: recorded allocation #0 1.0 MiB at train.py:7:embed" in text
    assert "| reserved peak | 64.0 MiB | 96.0 MiB | 1.5000 |" in text
    # a stream that goes elsewhere for good
    other = history([*STREAM[:2], *[(5 * MiB + k, f"other{k}") for k in range(40)]],
                     segment=512 * MiB)
    div = divergence(peaks(recorded).allocs, peaks(other).allocs)
    assert div["first"] == div["lasting"] == (2, 2) and div["num_matched"] == 2
    assert compare(recorded, recorded)["first_divergence"] is None


def test_a_predicted_snapshot_against_itself_and_a_late_recording(tmp_path):
    from orchestrator.cli.predict import predict_config
    from orchestrator.config import DEMO_TRACES
    from orchestrator.studies.predict import predict

    p = predict(predict_config(f"trace.dir={DEMO_TRACES / 'gpt_dp_4' / 'rank-0.et.json.gz'}",
                               "target=a100_40gb", "predict.snapshot=true"), tmp_path)
    snap = read_snapshot(tmp_path / "snapshot_rank0.pickle")
    same = compare(snap, snap)
    assert same["first_divergence"] is None
    assert same["predicted"]["reserved_peak_bytes"] == p.predicted_reserved_peak_bytes
    late = {**snap, "device_traces": [snap["device_traces"][0][40:]]}
    c = compare(late, snap)
    assert c["recorded"]["reserved_peak_bytes"] == p.predicted_reserved_peak_bytes
    assert c["first_divergence"]["predicted"]["index"] == 0  # it lacks the start


class _Evil:
    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.mark.parametrize("protocol", [0, 2, 4, 5])
def test_a_malicious_pickle_is_refused_unread(tmp_path, protocol):
    evil = _Evil()
    evil.marker = tmp_path / "pwned"
    path = tmp_path / "evil.pickle"
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": [[evil]]},
                                  protocol=protocol))
    with pytest.raises(SnapshotError, match=r"evil\.pickle: refused: the pickle asks for "
                                            r"(posix|os|nt)\.system"):
        read_snapshot(path)
    assert not evil.marker.exists()


def test_other_refusals_name_the_file_and_what_was_found(tmp_path):
    def refused(data: bytes, match: str):
        path = tmp_path / "x.pickle"
        path.write_bytes(data)
        with pytest.raises(SnapshotError, match=match) as e:
            read_snapshot(path)
        assert str(path) in str(e.value)

    refused(pickle.dumps({"segments": [], "device_traces": [{1, 2}]}), "holds a set")
    refused(pickle.dumps({"segments": [b"raw"], "device_traces": []}), "holds a bytes")
    refused(pickle.dumps(__import__("collections").OrderedDict()), "collections.OrderedDict")
    refused(pickle.dumps({"segments": []})[:-3], "not a readable pickle")
    refused(b"not a pickle at all", "not a readable pickle")
    refused(pickle.dumps({"nodes": []}), "not a memory snapshot")
    refused(pickle.dumps({"segments": [{"blocks": []}], "device_traces": []}), r"segments\[0\]")
    refused(pickle.dumps({"segments": [], "device_traces": [[{"size": 1}]]}),
            r"device_traces\[0\]\[0\]")
    with pytest.raises(SnapshotError, match="no such file"):
        read_snapshot(tmp_path / "missing.pickle")
    path = tmp_path / "big.pickle"
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": []}))
    with pytest.raises(SnapshotError, match="larger than the 8 B"):
        read_snapshot(path, max_bytes=8)
    # a bare list of segments (older snapshots) reads as a snapshot without history
    assert loads_snapshot(pickle.dumps([]))["device_traces"] == []


def _with(path: tuple, value) -> bytes:
    snap = history(STREAM)
    parent = snap
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = value
    return pickle.dumps(snap)


@pytest.mark.parametrize("path, value, message", [
    (("device_traces", 0, 3, "size"), 10 ** 400,
     r"device_traces\[0\]\[3\]\.size: an integer of 401 digits is not a byte count"),
    (("device_traces", 0, 2, "size"), -4096, r"device_traces\[0\]\[2\]\.size: -4096 is not a"),
    (("device_traces", 0, 1, "size"), float("nan"), r"\.size: nan is not a byte count"),
    (("device_traces", 0, 1, "size"), True, r"\.size: True is not a byte count"),
    (("device_traces", 0, 1, "frames"), 7, r"\[1\]\.frames: expected a list, found a int"),
    (("device_traces", 0, 1, "frames", 0, "filename"), [[["x"]]],
     r"frames\[0\]\.filename: expected a str, found a list"),
    (("segments", 0, "blocks", 0), 5, r"segments\[0\]\.blocks\[0\]: expected a dict"),
    (("segments", 0, "total_size"), 1 << 63, r"segments\[0\]\.total_size: 92233"),
    (("segments", 0, "device"), "cuda:0", r"segments\[0\]\.device: 'cuda:0' is not a device"),
])
def test_every_field_read_is_checked_before_use_and_named(tmp_path, path, value, message):
    """A snapshot from elsewhere with one bad field: refused naming the field and the value
    (a negative size used to be compared, 10**400 and a nested file name were tracebacks)."""
    with pytest.raises(SnapshotError, match=message):
        loads_snapshot(_with(path, value), "gpu.pickle")


def test_a_huge_frame_name_is_printed_cut(tmp_path):
    snap = history(STREAM)
    for event in snap["device_traces"][0]:  # the allocated peak is reached at "add"
        for frame in event.get("frames", ()):
            if frame["name"] == "add":
                frame["name"] = "op" * (1 << 20)
    text = "\n".join(compare_lines(compare(snap, history(STREAM)), "a", "b"))
    assert "... (2,097,152 characters)" in text and max(map(len, text.splitlines())) < 1000
