"""Which modules are ZeRO-3 leaves: by name pattern, or by DeepSpeed's granularity rule.

DeepSpeed's rule (``stage3_module_granularity_threshold``, runtime/zero/parameter_offload.py):
a module's granularity is its subtree's parameter elements divided by its layers, where a
layer is a torch leaf module with parameters plus one for the module itself; modules without
parameters, torch leaf modules and containers (ModuleList, ModuleDict: never called, so they
have no range of their own in the trace) never qualify; modules over 1e9 elements neither.
Walking from the root, the first module at or under the threshold becomes a leaf and its
subtree is not searched further. Patterns (fnmatch on qualified names, the root is
``<root>``) also pick parents first: a match inside a leaf is part of it.
"""
from __future__ import annotations

import sys
from fnmatch import fnmatchcase

from actors.errors import ConfigError
from actors.zero3.modules import ModuleTree, ancestors

_MAX_LEAF_NUMEL = 10**9  # DeepSpeed's Z3_MAX_LEAF_SIZE
_NEVER = sys.maxsize


def granularities(tree: ModuleTree) -> dict[str, int]:
    """DeepSpeed's granularity of every module (sys.maxsize where it never qualifies)."""
    children = tree.children
    out: dict[str, int] = {}

    def walk(name: str) -> tuple[int, int]:  # (layers, elements) of the subtree
        m = tree.modules[name]
        sub = [walk(c) for c in children(name)]
        numel = sum(p.numel for p in m.own) + sum(n for _, n in sub)
        out[name] = _NEVER
        if numel == 0:
            return 0, 0
        if not children(name):
            return 1, numel
        layers = sum(n for n, _ in sub)
        if not m.called:  # a container
            return layers, numel
        layers += 1
        if numel <= _MAX_LEAF_NUMEL:
            out[name] = numel // layers
        return layers, numel

    walk("")
    return out


def select_leaves(tree: ModuleTree, patterns: list[str], threshold: int) -> list[str]:
    """Leaf module names (parents win: no leaf inside another), sorted."""
    gran = granularities(tree) if threshold > 0 else {}
    unmatched = [p for p in patterns if not any(fnmatchcase(_label(n), p) for n in tree.modules)]
    if unmatched and len(tree.modules) == 1:
        raise ConfigError(f"zero3.leaf_modules {unmatched} match no module: the trace has no module "
                          "ranges; name its modules with zero3.modules (e.g. "
                          "'+zero3.modules={blocks.0:[0,1]}' zero3.modules_by=order: its whole "
                          "model is one root module, as it was not captured by tracefleet-capture)")
    if unmatched:
        names = sorted(_label(n) for n in tree.modules)
        raise ConfigError(f"zero3.leaf_modules: {unmatched} match no module of this trace; its "
                          f"modules are {', '.join(names[:12])}{' ...' if len(names) > 12 else ''} "
                          "(patterns match qualified names, not class names)")
    leaves: list[str] = []
    numel = _subtree_numel(tree)
    for name in sorted(tree.modules, key=lambda n: (n.count(".") + bool(n), n)):
        if any(a in leaves for a in ancestors(name)[1:]) or not numel[name]:
            continue
        by_pattern = any(fnmatchcase(_label(name), p) for p in patterns)
        if by_pattern or gran.get(name, _NEVER) <= threshold:
            leaves.append(name)
    return sorted(leaves)


def _subtree_numel(tree: ModuleTree) -> dict[str, int]:
    out: dict[str, int] = {}

    def walk(name: str) -> int:
        out[name] = sum(p.numel for p in tree.modules[name].own) + sum(map(walk, tree.children(name)))
        return out[name]
    walk("")
    return out


def _label(name: str) -> str:
    return name or "<root>"
