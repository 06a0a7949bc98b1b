"""Memory fidelity: measured memory, the faithful mode, flushing that acts in time and really
frees, and honest counters (coverage, OOM, frees of skipped ops, failures keeping iterations)."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch

from actors import cpu_counter
from actors.errors import ReplayError
from actors.replay.config import AllocationConfig, ReplayConfig
from actors.replay.engine import ReplayEngine
from actors.replay.extension_contract import ReplayExtension
from actors.trace import load_trace
from tests.support.et_json import node, scalar, step_node, tensor, write_trace
from tests.support.trace_factory import capture_step

MiB = 1 << 20
LAYER_NORM = ("aten::layer_norm(Tensor input, SymInt[] normalized_shape, Tensor? weight=None, "
              "Tensor? bias=None, float eps=1.0000000000000001e-05, bool cudnn_enable=True) -> Tensor")
RELU = "aten::relu(Tensor self) -> Tensor"
ONES = "aten::ones(SymInt[] size, *, ScalarType? dtype=None) -> Tensor"


@pytest.fixture(scope="module")
def step_trace(tmp_path_factory):
    return capture_step(tmp_path_factory.mktemp("et") / "rank-0.et.json")


def _cfg(alloc="lazy", threshold=1.0, **kw):
    base = dict(mode="compute", device="cpu", iters=1, warmup_iters=0)
    base.update(kw)
    return ReplayConfig(allocation=AllocationConfig(mode=alloc, device_memory_threshold=threshold),
                        **base)


def _run(trace, **kw):
    engine = ReplayEngine(trace, _cfg(**kw))
    return engine, engine.run().to_dict()


class _Probe(ReplayExtension):
    """Runs ``fn(engine)`` right after op ``index`` (optionally only in some iterations)."""

    name = "probe"

    def __init__(self, index: int, fn, before: bool = False):
        self.index, self.fn, self.before = index, fn, before
        self.iteration = 0
        self.engine = None

    def attach(self, engine):
        self.engine = engine

    def hooks(self):
        call = {self.index: [lambda: self.fn(self.engine, self.iteration)]}
        return (call, {}) if self.before else ({}, call)

    def on_iteration_end(self, measured):
        self.iteration += 1


def _layer_norm_trace(tmp_path, numel: int):
    """One layer_norm over [numel/2, 2] floats: the op allocates its output (numel floats)
    and, inside, mean and rstd (numel/2 floats each) that it frees before returning."""
    x = tensor(1, 1, numel, shape=[numel // 2, 2])
    out = tensor(2, 2, numel, shape=[numel // 2, 2])
    nodes = [step_node(3, 1),
             node(4, "aten::layer_norm", parent=3, inputs=[x, scalar([2], "GenericList[Int]")],
                  outputs=[out], schema=LAYER_NORM)]
    return load_trace(write_trace(tmp_path, nodes))


def test_measured_peak_sees_op_temporaries(tmp_path):
    numel = 1 << 20
    _, r = _run(_layer_norm_trace(tmp_path, numel))
    assert r["status"] == "ok", r["error"]
    # by hand: input + output + mean + rstd alive together inside the op
    expected = 4 * numel + 4 * numel + 2 * (4 * numel // 2)
    assert r["measured_peak_bytes"] == expected  # the counter is exact to the byte
    # accounting only knows the trace's tensors: input and output
    assert r["accounted_peak_bytes"] == 8 * numel
    assert r["peak_memory_bytes"] == r["measured_peak_bytes"]
    assert r["peak_memory_source"] == "measured"
    assert r["memory_measure_method"] == "cpu_allocator_counter"


def test_meta_cannot_measure(tmp_path):
    _, r = _run(_layer_norm_trace(tmp_path, 1 << 16), device="meta")
    assert r["status"] == "ok", r["error"]
    assert r["measured_peak_bytes"] is None and r["peak_memory_source"] == "accounted"
    assert r["peak_memory_bytes"] == r["accounted_peak_bytes"] == 8 * (1 << 16)


def test_memory_is_measured_in_every_timed_iteration_without_the_profiler(step_trace):
    seen = []

    def note(engine, iteration):
        seen.append((iteration, torch.autograd.profiler._is_profiler_enabled,
                     cpu_counter.installed()))

    trace = load_trace(step_trace)
    probe = _Probe(0, note, before=True)
    engine = ReplayEngine(trace, _cfg(iters=2, warmup_iters=1), extensions=[probe])
    r = engine.run().to_dict()
    assert r["status"] == "ok", r["error"]
    # no iteration of its own, no profiler: the counter runs through warm-up and timed ones
    assert seen == [(0, False, True), (1, False, True), (2, False, True)]
    assert len(r["iteration_times_s"]) == 2 and r["num_iterations_completed"] == 3
    per_iteration = r["memory_measure"]["peak_bytes_per_iteration"]
    assert len(per_iteration) == 2 and r["measured_peak_bytes"] == max(per_iteration)
    # every timed iteration starts from the persistent set the replay keeps across them
    starts = r["memory_measure"]["start_bytes_per_iteration"]
    assert len(starts) == 2 and starts[0] == starts[1] < min(per_iteration)
    engine.close()
    assert not cpu_counter.installed()  # torch's allocator is back


def test_a_meter_superseded_by_another_engine_reports_nothing(step_trace):
    trace = load_trace(step_trace)
    first = ReplayEngine(trace, _cfg())
    second = ReplayEngine(trace, _cfg())  # a new count: first's bytes are no longer counted
    r = first.run().to_dict()
    assert r["status"] == "ok", r["error"]
    assert r["measured_peak_bytes"] is None and r["memory_measure"]["superseded"]
    assert r["peak_memory_source"] == "accounted"
    assert second.run().to_dict()["measured_peak_bytes"] > 0
    first.close()
    second.close()


def test_a_collected_engine_gives_torch_its_allocator_back(step_trace):
    engine = ReplayEngine(load_trace(step_trace), _cfg())
    assert cpu_counter.installed()
    del engine
    gc.collect()
    assert not cpu_counter.installed()


def test_a_failed_engine_build_uninstalls_the_counter(step_trace):
    class Refuses(_Probe):
        def attach(self, engine):
            raise ReplayError("refused in attach")

    with pytest.raises(ReplayError, match="refused in attach"):
        ReplayEngine(load_trace(step_trace), _cfg(), extensions=[Refuses(0, None)])
    assert not cpu_counter.installed()


def test_measure_memory_off_runs_no_extra_iteration(step_trace):
    _, r = _run(load_trace(step_trace), iters=2, measure_memory=False)
    assert r["num_iterations_completed"] == 2 and r["measured_peak_bytes"] is None
    assert r["peak_memory_source"] == "accounted"


def test_faithful_keeps_persistent_storages_and_frees_intermediates_at_last_use(step_trace):
    trace = load_trace(step_trace)
    planned = ReplayEngine(trace, _cfg("faithful", iters=2))
    live = planned.liveness
    persistent = planned.policy.persistent
    assert persistent and all(live.storage_external[s] for s in persistent)
    # an intermediate: made by an op, used later, freed before the iteration ends
    produced = [(live.storage_first[s], live.storage_last[s], s) for s in range(trace.num_storages)
                if not live.storage_external[s] and live.storage_first[s] >= 0
                and live.storage_last[s] > live.storage_first[s] + 1
                and live.storage_last[s] < len(trace.ops) - 1 and live.storage_bytes[s] > 0]
    first, last, suid = produced[len(produced) // 2]
    refs, bases = [], []

    def grab(engine, iteration):  # right after the op that made it: hold only weak references
        refs.extend(weakref.ref(engine.store.tensors[u]) for u in live.uids_by_suid[suid]
                    if engine.store.tensors[u] is not None)

    def after_last_use(engine, iteration):
        gc.collect()
        assert refs and all(r() is None for r in refs), "the intermediate's tensors are still alive"
        assert not engine.memory.held[suid]
        refs.clear()

    def persistent_bases(engine, iteration):  # the very same storages in every iteration
        bases.append({s: engine.store._bases[s].data_ptr() for s in persistent})

    probes = [_Probe(first, grab), _Probe(last, after_last_use),
              _Probe(0, persistent_bases, before=True)]
    r = ReplayEngine(trace, _cfg("faithful", iters=2, warmup_iters=1),
                     extensions=probes).run().to_dict()
    assert r["status"] == "ok", r["error"]
    assert len(bases) == 3 and all(b == bases[0] for b in bases)  # 1 warm-up + 2 timed
    assert r["persistent_bytes"] == sum(live.storage_bytes[s] for s in persistent)


@pytest.mark.parametrize("alloc", ["pre_allocate", "lazy", "faithful"])
def test_accounting_does_not_drift_across_iterations(step_trace, alloc):
    engine = ReplayEngine(load_trace(step_trace), _cfg(alloc, iters=3))
    r = engine.run().to_dict()
    assert r["status"] == "ok", r["error"]
    persistent = engine.policy.persistent_bytes(engine.liveness.storage_bytes)
    assert engine.memory.held_bytes == sum(engine.memory.held) == persistent


def test_faithful_sits_between_lazy_and_pre_allocate(step_trace):
    trace = load_trace(step_trace)
    peaks = {mode: _run(trace, alloc=mode)[1]["accounted_peak_bytes"]
             for mode in ("lazy", "faithful", "pre_allocate")}
    assert peaks["lazy"] <= peaks["faithful"] < peaks["pre_allocate"]


def _flush_capacity(trace, alloc: str = "lazy") -> tuple[int, int]:
    """(capacity, unconstrained peak): a capacity below the mode's accounted peak in which
    every single op still fits next to the persistent set (so only flushing can help)."""
    engine = ReplayEngine(trace, _cfg(alloc))
    floor = engine.policy.persistent_bytes(engine.liveness.storage_bytes) + \
        max(s.touch_bytes for s in engine.steps)
    peak = engine.run().to_dict()["accounted_peak_bytes"]
    assert floor < peak, (floor, peak)
    return (floor + peak) // 2, peak


@pytest.mark.parametrize("alloc", ["lazy", "faithful"])
def test_flush_before_an_op_crosses_the_threshold_turns_oom_into_a_run(step_trace, alloc):
    trace = load_trace(step_trace)
    capacity, _ = _flush_capacity(trace, alloc)
    _, oom = _run(trace, alloc=alloc, device_memory_capacity=str(capacity))
    assert oom["status"] == "oom" and oom["num_flushes"] == 0
    assert 0 < oom["coverage"] < 1
    _, ok = _run(trace, alloc=alloc, device_memory_capacity=str(capacity), threshold=0.9)
    assert ok["status"] == "ok", ok["error"]
    assert ok["num_flushes"] > 0 and ok["flushed_bytes"] > 0 and ok["coverage"] == 1.0
    assert ok["accounted_peak_bytes"] <= capacity
    assert len(ok["flush_ticks"]) == ok["num_flushes"]


def test_lower_threshold_lowers_the_measured_peak(step_trace):
    trace = load_trace(step_trace)
    _, peak = _flush_capacity(trace)
    capacity = 2 * peak
    peaks = {}
    for threshold in (1.0, 0.3):
        _, r = _run(trace, device_memory_capacity=str(capacity), threshold=threshold)
        assert r["status"] == "ok", r["error"]
        peaks[threshold] = (r["measured_peak_bytes"], r["num_flushes"])
    assert peaks[1.0][1] == 0 and peaks[0.3][1] > 0
    assert peaks[0.3][0] < peaks[1.0][0]  # measured, not accounted: the flush really freed


def test_pre_allocate_counts_pinned_storages_once(step_trace):
    trace = load_trace(step_trace)
    _, free = _run(trace, alloc="pre_allocate")
    _, tight = _run(trace, alloc="pre_allocate", device_memory_capacity=str(free["accounted_peak_bytes"]))
    assert tight["status"] == "ok", tight["error"]


def test_oom_coverage_counts_only_ops_that_ran(step_trace):
    trace = load_trace(step_trace)
    bound = ReplayEngine(trace, _cfg()).liveness.lower_bound_bytes
    _, r = _run(trace, device_memory_capacity=str(bound // 4))
    assert r["status"] == "oom"
    oom_index = next(op.index for op in trace.ops if op.node_id == r["oom"]["node_id"])
    in_scope = r["num_in_scope"]
    assert r["coverage"] == pytest.approx(
        sum(1 for op in trace.ops[:oom_index] if op.collective is None) / in_scope)
    assert r["coverage"] < 1 and r["num_iterations_completed"] == 0


def test_skipped_op_frees_its_last_use_storages(tmp_path):
    n = 1 << 10
    a, b, c = tensor(1, 1, n), tensor(2, 2, n), tensor(3, 3, n)
    nodes = [step_node(3, 1),
             node(4, "aten::ones", parent=3, inputs=[scalar([n], "GenericList[Int]")], outputs=[a],
                  schema=ONES),
             node(5, "aten::relu", parent=3, inputs=[a], outputs=[b], schema=RELU),
             # an op this torch cannot run: its input's last use is here
             node(6, "aten::no_such_op", parent=3, inputs=[b], outputs=[c],
                  schema="aten::no_such_op(Tensor self) -> Tensor"),
             node(7, "aten::relu", parent=3, inputs=[a], outputs=[tensor(4, 4, n)], schema=RELU)]
    trace = load_trace(write_trace(tmp_path, nodes))
    held_after_skip = []
    probe = _Probe(2, lambda engine, it: held_after_skip.append(bool(engine.memory.held[trace.ops[2].inputs[0].suid])))
    r = ReplayEngine(trace, _cfg(), extensions=[probe]).run().to_dict()
    assert r["num_skipped"] == 1 and "no_such_op" in next(iter(r["skipped_reasons"]))
    assert held_after_skip and not any(held_after_skip)


def test_cpu_allocation_failure_is_an_oom(tmp_path):
    huge = 1 << 49  # 2 PiB of float32: accounted fits the stated capacity, the host refuses
    nodes = [step_node(3, 1),
             node(4, "aten::ones", parent=3, inputs=[scalar([huge], "GenericList[Int]")],
                  outputs=[tensor(1, 1, huge)], schema=ONES)]
    trace = load_trace(write_trace(tmp_path, nodes))
    _, r = _run(trace, device_memory_capacity="4PiB", measure_memory=False)
    assert r["status"] == "oom", r
    assert "allocate memory" in r["error"] and "node 4 aten::ones" in r["error"]
    assert r["skipped_reasons"] == {} and r["coverage"] == 0.0


def test_a_failure_keeps_the_iterations_before_it(step_trace):
    def fail_third(engine, iteration):
        if iteration == 2:
            raise RuntimeError("peer gone")

    trace = load_trace(step_trace)
    r = ReplayEngine(trace, _cfg(iters=3, measure_memory=False),
                     extensions=[_Probe(5, fail_third)]).run().to_dict()
    assert r["status"] == "failed" and "peer gone" in r["error"]
    assert len(r["iteration_times_s"]) == 2 and r["coverage"] == 1.0


def test_a_trace_with_nothing_in_scope_is_an_error(tmp_path):
    nodes = [step_node(3, 1), node(4, "aten::no_such_op", parent=3, inputs=[tensor(1, 1, 4)],
                                   outputs=[tensor(2, 2, 4)], schema="aten::no_such_op(Tensor self) -> Tensor")]
    trace = load_trace(write_trace(tmp_path, nodes))
    with pytest.raises(ReplayError, match="no op in scope"):
        ReplayEngine(trace, _cfg(mode="comms"))


def test_host_gaps_are_spent_before_their_ops(step_trace):
    from actors.replay.host_gaps import HostGaps

    trace = load_trace(step_trace)
    gaps = [0.0] * len(trace.ops)
    gaps[3], gaps[10] = 0.004, 0.006
    cfg = _cfg(iters=3, measure_memory=False)
    engine = ReplayEngine(trace, cfg, extensions=[HostGaps(gaps, "synthetic")])
    gapped = engine.run().to_dict()
    report = gapped["host_gaps"]
    assert report["num_gaps"] == 2 and report["recorded_s_per_iteration"] == pytest.approx(0.010)
    # spinning can only overshoot (a busy machine preempts the spinning thread)
    assert report["added_s_per_iteration"] >= 0.010
    assert min(gapped["iteration_times_s"]) >= 0.010
    # each gap is spent right before its op
    order = [entry[-1] for entry in engine.sequence(sampled=False, checked=False)]
    for i in (3, 10):
        at = next(k for k, step in enumerate(order) if step.op is not None and step.op.index == i)
        assert order[at - 1].kind == "hook"


def test_host_gaps_without_a_profiler_trace_is_a_clear_error(step_trace):
    with pytest.raises(ReplayError, match="kineto.json.gz"):
        ReplayEngine(load_trace(step_trace), _cfg(host_gaps=True))


def test_an_op_needing_values_on_meta_stands_in_with_its_recorded_output(tmp_path):
    repeat = "aten::repeat_interleave.Tensor(Tensor repeats, *, SymInt? output_size=None) -> Tensor"
    repeats = tensor(1, 1, 4, dtype="long int")
    out = tensor(2, 2, 10, dtype="long int")
    nodes = [step_node(3, 1),  # repeats: an input made before the trace
             node(5, "aten::repeat_interleave", parent=3, inputs=[repeats], outputs=[out],
                  schema=repeat),
             node(6, "aten::relu", parent=3, inputs=[out], outputs=[tensor(3, 3, 10, dtype="long int")],
                  schema=RELU)]
    trace = load_trace(write_trace(tmp_path, nodes))
    _, r = _run(trace, device="meta", iters=2, strict=True)
    assert r["status"] == "ok", r["error"]
    # the data-sized op returned the trace's output shape, so the op after it ran on it
    assert r["standin_ops"] == {"aten::repeat_interleave": 1}
    assert r["coverage"] == 1.0 and r["num_shape_mismatches"] == 0


def test_a_new_view_of_a_storage_an_op_made_aliases_it(tmp_path):
    """A tensor first seen as an input on a storage an op produced (a view the trace never
    recorded being made) is a view of that storage, not a new allocation."""
    n = 32
    made, view = tensor(1, 1, n, shape=[n]), tensor(2, 1, n, shape=[4, 8])
    nodes = [step_node(3, 1),
             node(4, "aten::ones", parent=3, inputs=[scalar([n], "GenericList[Int]")], outputs=[made],
                  schema=ONES),
             node(5, "aten::relu", parent=3, inputs=[view], outputs=[tensor(3, 2, n, shape=[4, 8])],
                  schema=RELU),
             node(6, "aten::relu", parent=3, inputs=[made], outputs=[tensor(4, 3, n)], schema=RELU)]
    trace = load_trace(write_trace(tmp_path, nodes))
    ptrs = []
    probe = _Probe(1, lambda engine, it: ptrs.append(
        [engine.store.tensors[t.uid].data_ptr() for t in (trace.ops[0].outputs[0], trace.ops[1].inputs[0])]))
    engine = ReplayEngine(trace, _cfg(), extensions=[probe])
    r = engine.run().to_dict()
    assert r["status"] == "ok", r["error"]
    assert ptrs and ptrs[0][0] == ptrs[0][1]
    # accounting knows it is one storage: a capacity of exactly the accounted peak suffices
    _, tight = _run(trace, device_memory_capacity=str(r["accounted_peak_bytes"]))
    assert tight["status"] == "ok", tight["error"]


def test_small_host_gaps_merge_into_fewer_waits_before_collectives(step_trace):
    from actors.replay.host_gaps import MERGE_S, HostGaps

    trace = load_trace(step_trace)
    small = MERGE_S / 4
    gaps = [small] * len(trace.ops)
    ext = HostGaps(gaps, "synthetic")
    ext.attach(ReplayEngine(trace, _cfg()))
    waits = ext.waits_s()
    # nothing is lost, and far fewer waits than gaps
    assert sum(waits.values()) == pytest.approx(sum(gaps))
    assert len(waits) < len(gaps) / 3
    # every collective gets what accumulated before it, so its timing across ranks holds
    for op in trace.collectives:
        assert op.index in waits


def test_an_oom_in_an_extension_hook_names_the_op_next_to_it(step_trace):
    from actors.replay.out_of_memory import OutOfMemory

    def refuse(engine, iteration):
        raise OutOfMemory(engine.memory.held_bytes, 1 << 30, 1 << 30)

    trace = load_trace(step_trace)
    r = ReplayEngine(trace, _cfg(measure_memory=False), extensions=[_Probe(7, refuse)]).run().to_dict()
    op = trace.ops[7]
    assert r["status"] == "oom" and r["oom"]["node_id"] == op.node_id
    assert f"hook (a ZeRO-3 fetch, ...) next to node {op.node_id} {op.name}" in r["error"]
    assert r["coverage"] == pytest.approx(sum(1 for o in trace.ops[:7] if o.collective is None)
                                          / r["num_in_scope"])


def test_an_owned_storage_is_accounted_by_its_owner_only(step_trace):
    trace = load_trace(step_trace)
    plain = ReplayEngine(trace, _cfg(measure_memory=False))
    # a parameter: made before the trace, updated in place by the optimizer step
    suid = next(iter(plain.policy.persistent or ()), None) or next(
        s for s in range(trace.num_storages) if plain.liveness.storage_external[s])

    class Owner(ReplayExtension):
        def owned_storages(self):
            return {suid}

        def attach(self, engine):
            self.engine = engine

        def hooks(self):  # bind a tensor before the first use, as ZeRO-3 does, charging nothing
            first = self.engine.liveness.storage_first[suid]
            t = next(t for t in trace.ops[first].input_tensors() + trace.ops[first].output_tensors()
                     if t.suid == suid)
            return {first: [lambda: [self.engine.store.bind(u, self.engine.store._allocate(u))
                                     for u in [t]]]}, {}

    engine = ReplayEngine(trace, _cfg(measure_memory=False), extensions=[Owner()])
    r = engine.run().to_dict()
    assert r["status"] == "ok", r["error"]
    assert not engine.memory.held[suid]  # never accounted by the store, even as an op output


def test_an_op_whose_input_a_flush_dropped_gets_it_back(tmp_path):
    """aten::contiguous takes a None input without raising (it returns None): when the flush
    right before it drops its input, the op must get the input back, not None."""
    from torch.profiler import ExecutionTraceObserver

    x = torch.ones(32, 32)  # 4 KiB, made before the trace
    et = ExecutionTraceObserver()
    et.register_callback(str(tmp_path / "rank-0.et.json"))
    et.start()
    (x + 1).t().contiguous()
    et.stop()
    et.unregister_callback()
    trace = load_trace(tmp_path / "rank-0.et.json")
    assert [op.name for op in trace.ops][-1] == "aten::contiguous"
    # at the contiguous: x + 1 held (4 KiB) and its copy to make (4 KiB) cross 0.4 x 16 KiB
    _, r = _run(trace, device_memory_capacity="16KiB", threshold=0.4)
    assert r["status"] == "ok", r["error"]
    assert r["num_flushes"] == 1 and r["coverage"] == 1.0


def test_after_a_flush_later_ops_get_their_inputs_back_too(tmp_path):
    """A flush drops storages that ops further on read; the rest of the iteration gathers and
    re-materializes inputs instead of trusting the plan (aten::contiguous would return None)."""
    from torch.profiler import ExecutionTraceObserver

    x = torch.ones(32, 32)  # 4 KiB, made before the trace
    et = ExecutionTraceObserver()
    et.register_callback(str(tmp_path / "rank-0.et.json"))
    et.start()
    y = (x + 1).t()           # y's storage: 4 KiB, read again at the end
    big = torch.ones(48, 32)  # 6 KiB: crosses the threshold, the flush drops y's storage
    (big * 2).sum()
    y.contiguous()
    et.stop()
    et.unregister_callback()
    trace = load_trace(tmp_path / "rank-0.et.json")
    assert [op.name for op in trace.ops][-1] == "aten::contiguous"
    engine = ReplayEngine(trace, _cfg(device_memory_capacity="24KiB", threshold=0.5, iters=2))
    r = engine.run().to_dict()
    assert r["status"] == "ok", r["error"]
    assert r["num_flushes"] >= 1 and r["coverage"] == 1.0
    assert r["num_shape_mismatches"] == 0 and r["skipped_reasons"] == {}


def test_a_host_gap_is_spent_before_the_async_collective_due_there_completes(step_trace):
    """The original may have worked or waited for an async collective during a gap: the gap
    comes first, then the replay's own wait (which costs nothing if the call finished)."""
    from actors.replay.host_gaps import HostGaps

    calls = []

    class Comm:  # a collective replayer with one async call due before op 5
        blocked_s = 0.0
        stats = type("S", (), {"reset": lambda self: None})()

        def hooks(self):
            return {5: [lambda: calls.append("complete")]}

        def wait_all(self):
            pass

    trace = load_trace(step_trace)
    gaps = [0.0] * len(trace.ops)
    gaps[5] = 0.001
    ext = HostGaps(gaps, "synthetic")
    engine = ReplayEngine(trace, _cfg(measure_memory=False), comm=Comm(), extensions=[ext])
    hooks = [entry[-1] for entry in engine.sequence(sampled=False, checked=False)
             if entry[-1].kind == "hook" and entry[-1].at == 5]
    assert len(hooks) == 2
    hooks[0].fn()
    assert calls == [] and ext._spent_ns[0] >= 1_000_000  # the gap first
    hooks[1].fn()
    assert calls == ["complete"]
