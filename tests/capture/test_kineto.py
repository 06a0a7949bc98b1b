"""Host gaps from the profiler trace beside an ET (actors/trace/kineto.py) and the profiler-only
timing capture writes (actors/capture/host_profile.py): hand-written traces with known gaps,
then a real recording with known busy-waits."""
from __future__ import annotations

import gzip
import time

import orjson
import pytest
import torch

from actors.capture.host_profile import UNLINKED_RF_ID, relabel
from actors.capture.recorder import record_iteration
from actors.errors import TraceError
from actors.trace import load_trace
from actors.trace.kineto import host_gaps_s, host_times, kineto_path_for, read_kineto_doc
from tests.support.et_json import ADD, RELU, node, step_node, tensor, write_trace

HOST, GLOO = 100, 200  # thread ids


def _et(tmp_path, name="rank-0.et.json"):
    """A step (node 10) with three ops (rf_id = node id = 11, 12, 13)."""
    x = tensor(1, 1, 4)
    nodes = [step_node(10, 3),
             node(11, "aten::relu", parent=10, inputs=[x], outputs=[tensor(2, 2, 4)], schema=RELU),
             node(12, "aten::add", parent=10, inputs=[x, x], outputs=[tensor(3, 3, 4)], schema=ADD),
             node(13, "aten::relu", parent=10, inputs=[x], outputs=[tensor(4, 4, 4)], schema=RELU)]
    return write_trace(tmp_path, nodes, name=name)


def _op(rf_id, name, ts, dur, tid=HOST):
    return {"ph": "X", "cat": "cpu_op", "name": name, "ts": ts, "dur": dur, "tid": tid,
            "args": {"Record function id": rf_id}}


def _kineto(path, events):
    doc = {"traceEvents": [{"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#3",
                            "ts": 1000.0, "dur": 500.0, "tid": HOST}] + events}
    path.write_bytes(gzip.compress(orjson.dumps(doc)))
    return path


# relu 1010-1030, add 1050-1060, relu 1100-1110: gaps 10, 20 and 40 us.
OPS = [_op(11, "aten::relu", 1010.0, 20.0), _op(12, "aten::add", 1050.0, 10.0),
       _op(13, "aten::relu", 1100.0, 10.0)]


def test_gaps_are_the_host_time_between_ops(tmp_path):
    trace = load_trace(_et(tmp_path))
    kineto = _kineto(tmp_path / "rank-0.kineto.json.gz", OPS)
    assert host_gaps_s(trace, kineto) == pytest.approx([10e-6, 20e-6, 40e-6])


def test_host_times_carry_each_ops_duration_and_the_step(tmp_path):
    trace = load_trace(_et(tmp_path))
    other = _kineto(tmp_path / "o.json.gz", OPS[:2] + [_op(13, "aten::relu", 1100.0, 10.0, GLOO)])
    host = host_times(trace, other)
    assert host.op_s == [pytest.approx(20e-6), pytest.approx(10e-6), 0.0]  # relu 13: not host
    assert host.step_s == pytest.approx(500e-6)
    assert host.gaps_s == host_gaps_s(trace, other)


def test_host_times_count_the_profiled_events_of_the_step(tmp_path):
    """Each event the profiler recorded on the host thread inside the step carries its
    bookkeeping: the three ops, a nested one, a range; not another thread's, not after."""
    trace = load_trace(_et(tmp_path))
    nested = {**_op(None, "aten::empty", 1012.0, 2.0), "args": {}}
    extra = [nested, {"ph": "X", "cat": "user_annotation", "name": "## module:x ##", "ts": 1005.0,
                      "dur": 100.0, "tid": HOST},
             _op(99, "aten::neg", 1070.0, 1.0, GLOO), _op(98, "aten::neg", 1600.0, 1.0)]
    host = host_times(trace, _kineto(tmp_path / "k.json.gz", OPS + extra))
    assert host.num_events == 5


def test_time_blocked_on_another_thread_is_not_host_time(tmp_path):
    """A gloo range ending inside a gap (the wait of a collective) starts the gap at its end."""
    trace = load_trace(_et(tmp_path))
    gloo = {"ph": "X", "cat": "user_annotation", "name": "gloo:all_reduce", "ts": 1061.0,
            "dur": 29.0, "tid": GLOO}  # ends at 1090, inside the 1060-1100 gap
    kineto = _kineto(tmp_path / "k.json.gz", OPS + [gloo])
    assert host_gaps_s(trace, kineto) == pytest.approx([10e-6, 20e-6, 10e-6])


def test_unknown_ops_and_other_threads_give_zero(tmp_path):
    trace = load_trace(_et(tmp_path))
    # add is not in the profile (a hook op the bare timing iteration never ran): 0.0, and the
    # next op's gap runs from the relu before it (1030) to its start (1100).
    kineto = _kineto(tmp_path / "k.json.gz", [OPS[0], _op(13, "aten::relu", 1100.0, 10.0)])
    assert host_gaps_s(trace, kineto) == [pytest.approx(10e-6), 0.0, pytest.approx(70e-6)]
    other = _kineto(tmp_path / "o.json.gz", OPS[:2] + [_op(13, "aten::relu", 1100.0, 10.0, GLOO)])
    assert host_gaps_s(trace, other) == [pytest.approx(10e-6), pytest.approx(20e-6), 0.0]


def test_bad_or_foreign_profiles_raise_naming_the_file(tmp_path):
    trace = load_trace(_et(tmp_path))
    bad = tmp_path / "bad.kineto.json"
    bad.write_text("{not json")
    with pytest.raises(TraceError, match="bad.kineto.json: invalid JSON"):
        host_gaps_s(trace, bad)
    with pytest.raises(TraceError, match="missing.kineto.json.gz: cannot read"):
        host_gaps_s(trace, tmp_path / "missing.kineto.json.gz")
    renamed = _kineto(tmp_path / "other.json.gz", [_op(11, "aten::mm", 1010.0, 20.0)])
    with pytest.raises(TraceError, match="none of the 3 ops .* links to this profiler trace"):
        host_gaps_s(trace, renamed)
    no_ids = _kineto(tmp_path / "noid.json.gz", [{"ph": "X", "cat": "cpu_op", "name": "x",
                                                  "ts": 1.0, "dur": 1.0, "tid": HOST}])
    with pytest.raises(TraceError, match="noid.json.gz: no cpu_op event carries"):
        host_gaps_s(trace, no_ids)


def test_kineto_path_for(tmp_path):
    et = tmp_path / "rank-3.et.json.gz"
    et.write_bytes(b"")
    assert kineto_path_for(et) is None
    (tmp_path / "rank-3.kineto.json.gz").write_bytes(b"")
    assert kineto_path_for(et) == tmp_path / "rank-3.kineto.json.gz"
    (tmp_path / "rank-1.kineto.json").write_bytes(b"")
    assert kineto_path_for(tmp_path / "rank-1.json") == tmp_path / "rank-1.kineto.json"
    assert kineto_path_for(tmp_path / "notes.txt") is None


def test_relabel_gives_the_timing_profile_the_et_profiles_ids():
    step = {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#3", "ts": 0, "dur": 900,
            "tid": HOST}
    a = {"traceEvents": [step, _op(11, "aten::relu", 10, 5), _op(12, "aten::mm", 20, 5),
                         _op(13, "aten::add", 30, 5), _op(14, "aten::view", 31, 1, tid=GLOO)]}
    # B: other ids, one extra op in the middle, the same worker-thread op.
    b = {"traceEvents": [dict(step, ts=1000), _op(91, "aten::relu", 1010, 5),
                         _op(92, "aten::zeros", 1015, 1), _op(93, "aten::mm", 1020, 5),
                         _op(94, "aten::add", 1030, 5), _op(95, "aten::view", 1031, 1, tid=GLOO)]}
    doc, aligned, total = relabel(a, b)
    ids = {e["name"]: e["args"].get("Record function id") for e in doc["traceEvents"]
           if e["cat"] == "cpu_op"}
    assert ids == {"aten::relu": 11, "aten::zeros": None, "aten::mm": 12, "aten::add": 13,
                   "aten::view": None}
    assert (aligned, total) == (3, 3)
    unlinked = [e["args"][UNLINKED_RF_ID] for e in doc["traceEvents"]
                if UNLINKED_RF_ID in e.get("args", {})]
    assert unlinked == [92, 95]  # kept for the record, never colliding with an ET id
    assert doc["tracefleet"]["aligned_host_ops"] == 3


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_recorded_gaps_match_known_host_time(tmp_path):
    """A real recording: 20 ms of Python between two ops shows up as that op's gap. The bounds
    come from the same run's own clock (the busy span measured around it), never from how fast
    this machine is: beside other jobs the busy loop is preempted and every span grows."""
    x = torch.ones(8)
    model = torch.nn.Linear(2, 2)  # the module ranges need a model; the step does not call it
    spans: list[dict] = []  # one per call of the step

    def step(_):
        t0 = time.perf_counter()
        y = x.mul(2.0)
        t1 = time.perf_counter()
        _busy(20e-3)
        t2 = time.perf_counter()
        y.add_(1.0)
        y.relu_()
        spans.append({"busy_s": t2 - t1, "step_s": time.perf_counter() - t0})

    et, kineto = tmp_path / "rank-0.et.json.gz", tmp_path / "rank-0.kineto.json.gz"
    result = record_iteration(step, None, model, 3, str(et), kineto_path=str(kineto))
    assert result["aligned_host_ops"] == result["et_host_ops"] > 0  # no module hooks here
    trace = load_trace(et)
    assert [op.name for op in trace.ops] == ["aten::mul", "aten::add_", "aten::relu_"]
    gaps = host_gaps_s(trace, kineto_path_for(et))
    # the busy loop lies between mul's end and add_'s start: add_'s gap holds all of it, and
    # no gap is longer than the step around it. The gaps are the profiled iteration's (the
    # fastest of three), one of the calls timed here: bounded by the calls' extremes (under
    # load one call's busy span grew to 23.4 ms while the profiled one's gap was 20.1 ms)
    busy, step_s = [c["busy_s"] for c in spans], [c["step_s"] for c in spans]
    assert len(spans) >= 3 and min(busy) >= 20e-3
    assert gaps[1] >= min(busy) * 0.99, (gaps, spans)
    assert gaps[1] <= max(step_s) * 1.01, (gaps, spans)
    # relu_'s gap lies after the busy span, inside the step
    assert gaps[2] <= max(c["step_s"] - c["busy_s"] for c in spans) * 1.01 + 1e-4, (gaps, spans)
    doc = read_kineto_doc(kineto)
    step_us = next(e["dur"] for e in doc["traceEvents"] if e.get("name") == "ProfilerStep#3")
    assert sum(gaps) * 1e6 < step_us  # host gaps are part of the step, never more


def test_profiler_op_cost_is_per_recorded_event():
    """Capture's micro-benchmark: one aten::add event per call, the cost the difference of
    the fastest profiled and bare loops over the events (never negative)."""
    from actors.capture.profiler_cost import profiler_op_cost
    from actors.capture.recorder import profiler_activities

    r = profiler_op_cost(profiler_activities(), num_ops=300, repeats=3)
    assert r["events_per_op"] == 1.0 and r["num_ops"] == 300
    assert r["bare_s"] > 0 and r["profiled_s"] > 0
    assert r["profiler_op_cost_s"] == pytest.approx(max(0.0, r["profiled_s"] - r["bare_s"]) / 300)


def test_profiler_trace_gzip_bomb_is_refused_naming_the_file(tmp_path):
    bomb = tmp_path / "rank-0.kineto.json.gz"
    bomb.write_bytes(gzip.compress(b'{"traceEvents": []' + b" " * (8 << 20) + b"}"))
    with pytest.raises(TraceError, match=r"rank-0.kineto.json.gz: expands past the limit of "
                                         r"1,048,576 bytes; a profiler trace of one iteration"):
        read_kineto_doc(bomb, max_bytes=1 << 20)
    assert read_kineto_doc(bomb, max_bytes=16 << 20)["traceEvents"] == []
    plain = tmp_path / "big.kineto.json"
    plain.write_bytes(b'{"traceEvents": []' + b" " * (2 << 20) + b"}")
    with pytest.raises(TraceError, match="big.kineto.json: expands past the limit"):
        read_kineto_doc(plain, max_bytes=1 << 20)


@pytest.mark.parametrize("bad", [{"ts": "1010"}, {"ts": None}, {"dur": -5.0}, {"dur": [1]},
                                 {"ts": float("nan")}])
def test_a_malformed_event_time_is_an_error_naming_it(tmp_path, bad):
    """The gaps come from ts/dur: a malformed one used to be skipped (a silently wrong gap)."""
    trace = load_trace(_et(tmp_path))
    kineto = _kineto(tmp_path / "rank-0.kineto.json.gz", [{**OPS[0], **bad}] + OPS[1:])
    key = next(iter(bad))
    with pytest.raises(TraceError, match=rf"rank-0.kineto.json.gz: traceEvents: complete event "
                                         rf"#1 \('aten::relu'\) has {key}="):
        host_gaps_s(trace, kineto)
