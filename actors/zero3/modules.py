"""The module tree of a trace: which ops each module ran, in forward and backward, and which
parameters it owns.

Forward: every op inside a ``## module:<qualname> ##`` range belongs to that module and its
ancestors (qualified names nest by dots; the root module is ``""``). A module's forward
*runs* are the maximal stretches of ops under it; an op of a module outside it, or a backward
op (an autograd node's range: ``...Backward0``, ``AccumulateGrad``), ends a run, other ops
(hooks' own ranges, no range) do not. Backward: the stretches between the module's backward
markers (actors/zero3/markers.py). A parameter is owned by the innermost module whose forward
first uses it (DeepSpeed's rule: a module fetches its own parameters). Modules named only in
``zero3.modules`` (traces without ranges) run wherever their parameters are used.

Phases (per ProfilerStep window): ops before the first backward op are forward, ops up to the
last backward op are backward, the rest is the update (the optimizer step).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from actors.trace.conventions import FORWARD, parse_module_range
from actors.trace.model import Trace
from actors.trace.phases import BWD, FWD, UPDATE, is_backward_op, phases  # noqa: F401 (re-exported)
from actors.zero3.params import Param



@dataclass
class Module:
    """One module of the trace's tree."""

    name: str  # qualified name; "" is the root
    forward: list[tuple[int, int]] = field(default_factory=list)  # runs as (first op, last op)
    backward: list[tuple[int, int]] = field(default_factory=list)  # (begin, end) boundaries
    own: list[Param] = field(default_factory=list)  # parameters it fetches itself
    called: bool = False  # ran an op of its own or has backward markers (not a bare container)

    @property
    def label(self) -> str:
        return self.name or "<root>"


class ModuleTree:
    """Modules by qualified name, with parent/child links derived from the names."""

    def __init__(self):
        # The root always exists: a trace without module ranges is one root module (the
        # walks from "" in leaves.py start there), owning nothing of its own.
        self.modules: dict[str, Module] = {"": Module("")}
        self._children: dict[str, list[str]] | None = None  # built on first use, once complete

    def get(self, name: str) -> Module:
        """The module ``name``, created with its ancestors on first mention."""
        m = self.modules.get(name)
        if m is None:
            m = self.modules[name] = Module(name)
            self._children = None
            if name:
                self.get(parent_name(name))
        return m

    def children(self, name: str) -> list[str]:
        """Names of ``name``'s direct children."""
        if self._children is None:
            self._children = {n: [] for n in self.modules}
            for n in self.modules:
                if n:
                    self._children[parent_name(n)].append(n)
        return self._children[name]

    def subtree(self, name: str) -> list[Module]:
        """``name`` and every module under it."""
        out, todo = [], [name]
        while todo:
            n = todo.pop()
            out.append(self.modules[n])
            todo += self.children(n)
        return out

    def subtree_params(self, name: str) -> list[Param]:
        return [p for m in self.subtree(name) for p in m.own]


def parent_name(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else ""


def ancestors(name: str) -> list[str]:
    """``name`` and its ancestors up to the root ``""``."""
    out = [name]
    while name:
        name = parent_name(name)
        out.append(name)
    return out


def op_module(op) -> str | None:
    """The qualified name of the module range an op ran in, None outside module ranges."""
    parsed = parse_module_range(op.module) if op.module.startswith("## ") else None
    return parsed[0] if parsed is not None and parsed[1] == FORWARD else None


def build_tree(trace: Trace, params: list[Param], backward: dict[str, list[tuple[int, int]]],
               mapping: dict[str, list[Param]] | None = None) -> ModuleTree:
    """The tree of ``trace``'s module ranges plus the ``mapping`` modules, with forward runs,
    ``backward`` stretches (from the markers) and owned parameters."""
    tree = ModuleTree()
    open_runs: dict[str, list[int]] = {}
    first_owner: dict[int, str] = {}  # suid -> innermost module of its first forward use
    by_suid = {p.suid: p for p in params}
    for op in trace.ops:
        name = op_module(op)
        if name is None:
            if is_backward_op(op):
                _close(tree, open_runs, keep=())
            continue
        tree.get(name).called = True
        chain = ancestors(name)
        _close(tree, open_runs, keep=chain)
        for m in chain:
            run = open_runs.setdefault(m, [op.index, op.index])
            run[1] = op.index
        for t in op.input_tensors() + op.output_tensors():
            if t.suid in by_suid:
                first_owner.setdefault(t.suid, name)
    _close(tree, open_runs, keep=())
    for name, windows in backward.items():
        m = tree.get(name)
        m.backward = list(windows)
        m.called = True
    mapped = {p.suid for ps in (mapping or {}).values() for p in ps}
    for p in params:
        if p.suid in first_owner and p.suid not in mapped:
            tree.get(first_owner[p.suid]).own.append(p)
    for name, ps in (mapping or {}).items():
        tree.get(name).own.extend(ps)
    return tree


def _close(tree: ModuleTree, open_runs: dict[str, list[int]], keep) -> None:
    for m in [m for m in open_runs if m not in keep]:
        first, last = open_runs.pop(m)
        tree.get(m).forward.append((first, last))
