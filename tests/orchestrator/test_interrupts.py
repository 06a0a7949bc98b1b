"""SIGINT and SIGTERM as exceptions (orchestrator/interrupts.py), and the exit status and the
one line the console scripts give them (orchestrator/cli/app.py); in this process, no Ray."""
from __future__ import annotations

import os
import signal
import time

import pytest

from orchestrator import interrupts
from orchestrator.cli.app import guarded


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_raises_inside_the_block_and_the_handlers_come_back(signum):
    before = signal.getsignal(signum)
    with pytest.raises(KeyboardInterrupt) as err:
        with interrupts.stop_on_signals():
            os.kill(os.getpid(), signum)
            time.sleep(5)  # the handler raises before this ends
    assert isinstance(err.value, interrupts.Interrupted) and err.value.signum == signum
    assert interrupts.signal_of(err.value) == signum
    assert interrupts.name_of(err.value) == signal.Signals(signum).name
    assert signal.getsignal(signum) is before


def test_a_plain_keyboard_interrupt_keeps_the_signal_that_caused_it():
    """Ray's ray.wait re-raises a signal handler's exception as a plain KeyboardInterrupt:
    the signal is the one the handler saw."""
    with pytest.raises(KeyboardInterrupt):
        with interrupts.stop_on_signals():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
    assert interrupts.signal_of(KeyboardInterrupt()) == signal.SIGTERM


def test_an_argparse_command_exits_128_plus_the_signal_with_one_line(capsys):
    def body() -> int:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
        return 0

    assert guarded("tracefleet-inspect", body, debug=False) == 143
    assert capsys.readouterr().err == "tracefleet-inspect: interrupted by SIGTERM\n"
