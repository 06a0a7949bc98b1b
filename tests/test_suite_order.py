"""The suite's order (tests/conftest.py): files holding a slow test first, each file whole and
in collection order, so the minutes-long files start while the rest fill in around them."""
from __future__ import annotations

from pathlib import Path

from tests.conftest import pytest_collection_modifyitems


class _Item:
    def __init__(self, path: str, name: str, slow: bool = False):
        self.path, self.name, self.slow = Path(path), name, slow

    def get_closest_marker(self, name: str):
        return object() if name == "slow" and self.slow else None


def test_files_with_a_slow_test_move_to_the_front_whole_and_in_order():
    items = [_Item("a.py", "a1"), _Item("b.py", "b1"), _Item("b.py", "b2", slow=True),
             _Item("c.py", "c1"), _Item("d.py", "d1", slow=True), _Item("d.py", "d2")]
    pytest_collection_modifyitems(None, items)
    assert [i.name for i in items] == ["b1", "b2", "d1", "d2", "a1", "c1"]


def test_every_benchmark_smoke_test_is_in_the_long_job():
    """A test running a benchmark script whole (run_bench) is marked ``long``, for CI's
    second job (scripts/test.sh --long), not left in the suite's run by forgetting the mark."""
    bench_dir = Path(__file__).resolve().parent / "bench"
    calling = [p for p in sorted(bench_dir.glob("test_*.py")) if "run_bench(" in p.read_text()]
    assert calling, "no benchmark smoke test found"
    unmarked = [p.name for p in calling if "pytest.mark.long" not in p.read_text()]
    assert unmarked == []
