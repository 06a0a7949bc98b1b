"""The bound on code that runs in this process (actors/time_limit.py): a block that never
returns is stopped at its bound, past a broad ``except Exception``, naming where it was."""
from __future__ import annotations

import threading
import time

import pytest

from actors.time_limit import TimeLimitError, time_limit
from tests.support.bounds import LOAD_MARGIN_S


def _spin():
    while True:
        try:
            time.sleep(0.01)
        except Exception:  # noqa: BLE001 (the user's code may catch everything)
            pass


def test_a_block_that_never_returns_is_stopped_at_its_bound():
    start = time.monotonic()
    with pytest.raises(TimeLimitError, match=r"capture_timeout_s=0.5: the capture did not finish "
                                             r"within 0.5 s \(stopped at .*test_time_limit.py:\d+ "
                                             r"in _spin\); raise capture_timeout_s"):
        with time_limit(0.5, "capture_timeout_s"):
            _spin()
    assert time.monotonic() - start < 0.5 + LOAD_MARGIN_S


def test_a_stop_that_makes_a_cleanup_fail_is_still_the_bounds_error():
    """A cleanup the stop made fail (see test_memory_limit.py's twin) does not hide the bound."""
    with pytest.raises(TimeLimitError, match=r"capture_timeout_s=0.2: the capture did not finish "
                                             r"within 0.2 s \(stopped at .*test_time_limit.py"):
        with time_limit(0.2, "capture_timeout_s"):
            try:
                _spin()
            finally:
                raise RuntimeError("trying to set the current FakeTensorMode, but one already "
                                   "exists")


def test_a_block_that_ends_in_time_is_left_alone_and_the_timer_is_disarmed():
    with time_limit(5, "capture_timeout_s"):
        value = sum(range(1000))
    time.sleep(0.1)
    assert value == 499500
    with pytest.raises(ValueError, match="its own error"):  # other errors go through as they are
        with time_limit(5, "capture_timeout_s"):
            raise ValueError("its own error")


def test_off_the_main_thread_the_block_runs_unbounded():
    seen = []

    def work():
        with time_limit(0.01, "capture_timeout_s"):
            time.sleep(0.2)
        seen.append("done")

    thread = threading.Thread(target=work)
    thread.start()
    thread.join(10)
    assert seen == ["done"]


def _waits():
    time.sleep(3600)


def _moves(seconds: float) -> int:
    """Compute for ``seconds`` (sampled, always at the loop's line)."""
    end, done = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        done += sum(range(1000))
        done += len(str(done))
    return done


def test_a_block_waiting_at_one_place_is_stopped_at_its_stall_bound_a_busy_one_is_not():
    start = time.monotonic()
    with pytest.raises(TimeLimitError, match=r"capture_stall_s=0.6: the capture made no progress "
                                             r"for 0.6 s: it stayed at .*test_time_limit.py:\d+ "
                                             r"in _waits \(a wait or a loop"):
        with time_limit(600, "capture_timeout_s", stall_s=0.6):
            _waits()
    assert time.monotonic() - start < 600 - LOAD_MARGIN_S  # not the whole bound
    with pytest.raises(TimeLimitError, match=r"in _spin"):  # a loop of waits, too
        with time_limit(600, "capture_timeout_s", stall_s=0.6):
            _spin()
    with time_limit(600, "capture_timeout_s", stall_s=0.3):
        assert _moves(1.5) > 0  # 5 stall bounds long at one line, computing
    with pytest.raises(TimeLimitError, match=r"capture_timeout_s=0.5: the capture did not "
                                             r"finish"):  # the whole bound still holds
        with time_limit(0.5, "capture_timeout_s", stall_s=60):
            _moves(600)
