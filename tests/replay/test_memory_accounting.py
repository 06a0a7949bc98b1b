"""The memory tracker's one bookkeeping path (actors/replay/memory/accounting.py): the op
loop's fast ``add_new`` equals ``add`` (also on a storage already held), over many random operation
sequences (seeded: the same sequences every run), with and without an observer."""
from __future__ import annotations

import random

import pytest

from actors.replay.memory.accounting import MemoryTracker, sample_points
from actors.trace.categories import CATEGORIES

NUM_STORAGES = 24
NUM_SEQUENCES = 300
NUM_OPS = 120


class _Recorder:
    """An observer that keeps every event."""

    def __init__(self):
        self.events = []

    def held(self, suid, nbytes):
        self.events.append(("held", suid, nbytes))

    def released(self, suid):
        self.events.append(("released", suid))

    def charged(self, nbytes, category, host=False):
        self.events.append(("charged", nbytes, category, host))

    def discharged(self, nbytes, category, host=False):
        self.events.append(("discharged", nbytes, category, host))


def _state(m: MemoryTracker) -> tuple:
    return (list(m.held), m.held_bytes, m.peak_bytes, m.high_bytes, m.low_bytes,
            list(m.category_bytes), list(m.peak_category_bytes), m.peak_step,
            list(m.timeline), list(m.flush_ticks))


def _tracker(rng: random.Random, categories: list[int]) -> MemoryTracker:
    m = MemoryTracker(NUM_STORAGES, None)
    m.categories = list(categories)
    return m


def _operations(rng: random.Random) -> list[tuple]:
    """A random sequence: fresh outputs (the op loop's adds; one in four of a storage already
    held, as a trace that reuses a storage id makes them), adds of any storage (the
    store's materializations, held or not), releases, extension charges and discharges,
    timeline samples, flush notes and the running step."""
    ops, held, charged = [], set(), []
    for i in range(NUM_OPS):
        kind = rng.choice(("new", "new", "add", "release", "release", "charge", "discharge",
                           "sample", "step", "flush"))
        suid = rng.randrange(NUM_STORAGES)
        nbytes = rng.choice((0, 1, rng.randrange(1, 1 << 20)))
        if kind == "new" and rng.random() < 0.75:
            free = [s for s in range(NUM_STORAGES) if s not in held]
            if not free:
                continue
            suid = rng.choice(free)
        if kind in ("new", "add") and nbytes:
            held.add(suid)
        elif kind == "release":
            held.discard(suid)
        elif kind == "charge":
            charged.append((nbytes, rng.randrange(len(CATEGORIES)), rng.random() < 0.2))
            ops.append(("charge",) + charged[-1])
            continue
        elif kind == "discharge":
            if not charged:
                continue
            ops.append(("discharge",) + charged.pop(rng.randrange(len(charged))))
            continue
        ops.append((kind, suid, nbytes, i))
    return ops


def _apply(m: MemoryTracker, ops: list[tuple], fast: bool) -> list[tuple]:
    """Run ``ops`` on ``m``, fresh outputs through ``add_new`` (``fast``) or ``add``; the
    state after every operation."""
    states = []
    for op in ops:
        kind = op[0]
        if kind == "new":
            (m.add_new if fast else m.add)(op[1], op[2])
        elif kind == "add":
            m.add(op[1], op[2])
        elif kind == "release":
            assert m.release(op[1]) >= 0
        elif kind == "charge":
            m.charge(*op[1:])
        elif kind == "discharge":
            m.discharge(*op[1:])
        elif kind == "sample":
            m.sample(op[3])
        elif kind == "flush":
            m.note_flush(op[3])
        else:
            m.step = ("step", op[3])
        states.append(_state(m))
    return states


@pytest.mark.parametrize("observed", [False, True])
def test_the_fast_add_equals_add_on_random_sequences(observed):
    for seed in range(NUM_SEQUENCES):
        rng = random.Random(seed)
        categories = [rng.randrange(len(CATEGORIES)) for _ in range(NUM_STORAGES)]
        ops = _operations(rng)
        reference, fast = _tracker(rng, categories), _tracker(rng, categories)
        recorders = _Recorder(), _Recorder()
        if observed:
            reference.observe(recorders[0])
            fast.observe(recorders[1])
        assert _apply(fast, ops, fast=True) == _apply(reference, ops, fast=False), seed
        assert recorders[1].events == recorders[0].events, seed


def test_the_observer_sees_every_transition_of_held():
    """Observed, each storage's held/released events are exactly its 0 <-> nonzero changes."""
    for seed in range(50):
        rng = random.Random(seed)
        ops = _operations(rng)
        m, rec = _tracker(rng, [0] * NUM_STORAGES), _Recorder()
        m.observe(rec)
        expected, before = [], [0] * NUM_STORAGES
        for op in ops:
            _apply(m, [op], fast=True)
            for s, (old, new) in enumerate(zip(before, m.held)):
                if not old and new:
                    expected.append(("held", s, new))
                elif old and not new:
                    expected.append(("released", s))
            if op[0] in ("charge", "discharge"):
                expected.append((op[0] + "d",) + op[1:])
            before = list(m.held)
        assert rec.events == expected, seed


def test_held_bytes_is_the_held_storages_plus_the_charges():
    rng = random.Random(7)
    m = _tracker(rng, [0] * NUM_STORAGES)
    ops = _operations(rng)
    _apply(m, ops, fast=True)
    charges = [op for op in ops if op[0] == "charge"]
    discharges = [op for op in ops if op[0] == "discharge"]
    assert m.held_bytes == sum(m.held) + sum(op[1] for op in charges) - \
        sum(op[1] for op in discharges)
    assert m.peak_bytes >= m.held_bytes and m.peak_bytes >= m.high_bytes


def test_sample_points_cover_every_op():
    assert sample_points(10, 4) == [2, 5, 8, 9]
    assert sample_points(0, 4) == []
