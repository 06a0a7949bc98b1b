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
