"""The op loop's sequence: what one iteration runs, in order, as flat tuples.

An entry is ``fast tuple + (frees, step)``: the step's fast tuple (``step_plan.set_fast_path``;
Nones for a step off the fast path), the storages the allocation policy frees right after it,
and the step. Extension hooks become entries of their own around the op they are planned
next to; the first iteration also samples the memory timeline through hook entries, so later
iterations pay nothing for it.

Two variants of the fast path exist. *Fast*: arguments come from one ``itemgetter`` over the
registry where the plan proved them registered before the op runs. *Checked*: every fast op
gathers its arguments and materializes what is missing. A flush drops storages the plan
assumed held, so the loop switches to the checked variant for the rest of that iteration.
"""
from __future__ import annotations

from functools import partial

from actors.replay.memory.accounting import sample_points
from actors.replay.step_plan import Step

NOT_FAST = (None,) * 7  # the fast tuple's slots of an entry off the fast path


def hook_entry(fn, at: int) -> tuple:
    """An entry running ``fn`` next to op ``at`` (named in errors the hook raises)."""
    return NOT_FAST + ((), Step(None, "hook", fn=fn, at=at))


def merge_hooks(hooks: list[tuple[dict, dict]]) -> tuple[dict, dict]:
    """One ``(before, after)`` pair of op index -> callables from several, in order."""
    before: dict[int, list] = {}
    after: dict[int, list] = {}
    for b, a in hooks:
        for i, fns in b.items():
            before.setdefault(i, []).extend(fns)
        for i, fns in a.items():
            after.setdefault(i, []).extend(fns)
    return before, after


def build(steps: list[Step], free_lists: list[tuple], hooks: tuple[dict, dict],
          samples: set[int], sample, checked: bool, gather) -> list[tuple]:
    """The entries of one iteration (out-of-scope ops that free nothing are left out).

    ``samples``: op indices after which ``sample(index)`` records the timeline; ``checked``:
    fast ops gather their arguments (``gather(template, slots, registry)``).
    """
    before, after = hooks
    seq = []
    for i, step in enumerate(steps):
        seq += [hook_entry(fn, i) for fn in before.get(i, ())]
        if step.kind in ("compute", "collective", "failed") or free_lists[i]:
            fast = step.fast
            if fast is None:
                fast = NOT_FAST
            elif checked:
                fast = (fast[0], partial(gather, step.template, step.tensor_slots)) + fast[2:]
            seq.append(fast + (free_lists[i], step))
        seq += [hook_entry(fn, i) for fn in after.get(i, ())]
        if i in samples:
            seq.append(hook_entry(partial(sample, i), i))
    return seq


class Sequences:
    """An iteration's entries per variant, built on first use and rebuilt after ``clear``
    (a step changed: a stand-in, a failure, recorded outputs installed)."""

    def __init__(self, steps: list[Step], free_lists: list[tuple], hooks: tuple[dict, dict],
                 memory, gather):
        self.steps, self.free_lists, self.hooks = steps, free_lists, hooks
        self.memory, self.gather = memory, gather
        self._built: dict[tuple[bool, bool], list] = {}  # (sampled, checked) -> entries

    def get(self, sampled: bool, checked: bool) -> list[tuple]:
        """The entries of an iteration (``build``): ``sampled`` records the memory timeline."""
        key = (sampled, checked)
        if key not in self._built:
            samples = set(sample_points(len(self.steps), self.memory.max_points)) \
                if sampled else set()
            self._built[key] = build(self.steps, self.free_lists, self.hooks, samples,
                                     self.memory.sample, checked, self.gather)
        return self._built[key]

    def clear(self) -> None:
        self._built.clear()
