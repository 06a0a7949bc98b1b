"""The keys of a benchmark's one JSON line, declared once per script.

Every ``scripts/bench_*.py`` declares ``KEYS``, the layout of the line its full run prints (its
``--quick`` run prints the same, on tiny inputs), and prints through `emit`, which refuses a
line that strays from it. tests/bench/ checks each quick line against the same
``KEYS``, so a key the script stops printing fails the test, and a key added to the line
without adding it to ``KEYS`` fails both the test and the next full run.

A layout is ``None`` (a figure: any value, null included), ``{key: layout}`` (exactly these
keys), ``{EACH: layout}`` (keys named by the inputs, such as rank counts or folder names: at
least one, each value of that layout) or ``[layout]`` (a non-empty list, each item of that
layout).
"""
from __future__ import annotations

import json
import sys

EACH = "*"


def mismatches(value, layout, where: str = "line") -> list[str]:
    """Every way ``value`` strays from ``layout``, one line each (empty: it matches)."""
    if layout is None:
        return []
    if isinstance(layout, list):
        if not isinstance(value, list) or not value:
            return [f"{where}: expected a non-empty list, got {_kind(value)}"]
        return [m for i, item in enumerate(value) for m in mismatches(item, layout[0],
                                                                      f"{where}[{i}]")]
    if not isinstance(value, dict):
        return [f"{where}: expected an object, got {_kind(value)}"]
    if set(layout) == {EACH}:
        if not value:
            return [f"{where}: expected at least one key"]
        return [m for k, v in value.items() for m in mismatches(v, layout[EACH], f"{where}.{k}")]
    problems = []
    if missing := sorted(set(layout) - set(value)):
        problems.append(f"{where}: missing {missing}")
    if extra := sorted(set(value) - set(layout)):
        problems.append(f"{where}: not in KEYS {extra}")
    return problems + [m for k, sub in layout.items() if k in value
                       for m in mismatches(value[k], sub, f"{where}.{k}")]


def emit(line: dict, layout) -> None:
    """Print ``line`` as one JSON line, then exit 1 naming every way it strays from ``layout``
    (printed first, so a long run's figures are not lost to a stale ``KEYS``)."""
    print(json.dumps(line), flush=True)
    if problems := mismatches(line, layout):
        sys.exit("the JSON line does not match the script's KEYS: " + "; ".join(problems))


def _kind(value) -> str:
    return "null" if value is None else type(value).__name__
