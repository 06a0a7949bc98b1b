"""The check every benchmark smoke test rests on (scripts/json_layout.py): a script's JSON line
against the keys it declares for a full run."""
from __future__ import annotations

from scripts.json_layout import mismatches


def test_layout_check_names_every_stray_key():
    """The check the smoke tests rest on: a missing, an extra and a nested key each named."""
    layout = {"a": None, "rows": [{"x": None}], "by_rank": {"*": {"s": None}}}
    assert mismatches({"a": 1, "rows": [{"x": 2}], "by_rank": {"8": {"s": 1}}}, layout) == []
    assert mismatches({"rows": [{"x": 2, "y": 3}], "by_rank": {}, "b": 0}, layout) == [
        "line: missing ['a']", "line: not in KEYS ['b']", "line.rows[0]: not in KEYS ['y']",
        "line.by_rank: expected at least one key"]
    assert mismatches({"a": 1, "rows": [], "by_rank": None}, layout) == [
        "line.rows: expected a non-empty list, got list",
        "line.by_rank: expected an object, got null"]
