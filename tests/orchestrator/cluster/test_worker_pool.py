"""The local worker processes fit_search's axes and a mesh job's roles run in
(orchestrator/cluster/worker_pool.py) and a second signal
(orchestrator/interrupts.py): no process a command started outlives it."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil

import pytest

from orchestrator.cluster.worker_pool import (WorkerDied, in_fresh_processes, in_workers,
                                               tell_parent)
from tests.support.bounds import LOAD_MARGIN_S

START_TIMEOUT_S = 120  # spawned workers import this project on a loaded machine


def test_results_come_in_the_tasks_order():
    assert list(in_workers(divmod, [(7, 2), (9, 4), (1, 1)], 2)) == [(3, 1), (2, 1), (1, 0)]


def _pid_after(label: str, wait_s: float) -> tuple[str, int]:
    tell_parent(f"{label} started")
    time.sleep(wait_s)
    return label, os.getpid()


def test_fresh_processes_run_each_task_in_a_process_of_its_own_in_order():
    seen = []
    results = list(in_fresh_processes(_pid_after, [("a", 0.5), ("b", 0.0), ("c", 0.0)], 2,
                                      on_message=seen.append))
    assert [label for label, _ in results] == ["a", "b", "c"]  # b ends first, comes second
    assert len({pid for _, pid in results} | {os.getpid()}) == 4
    assert sorted(seen) == ["a started", "b started", "c started"]


def _wait_for(label: str, marker: str, timeout_s: float) -> tuple[str, bool]:
    """Touch ``marker``-<label>, then (for "a") wait until the marker of "c" exists: whether
    it appeared."""
    open(f"{marker}-{label}", "w").close()
    deadline = time.monotonic() + timeout_s
    while label == "a" and time.monotonic() < deadline:
        if os.path.exists(f"{marker}-c"):
            return label, True
        time.sleep(0.05)
    return label, label != "a"


def test_a_slot_is_filled_when_any_task_ends(tmp_path):
    """b ends at once while a still runs: c starts in b's slot, before a has ended (and the
    results still come in the tasks' order)."""
    marker = str(tmp_path / "started")
    results = list(in_fresh_processes(_wait_for, [("a", marker, START_TIMEOUT_S),
                                                  ("b", marker, 0), ("c", marker, 0)], 2))
    assert results == [("a", True), ("b", True), ("c", True)]


def _leaves_an_exit_handler(marker: str) -> str:
    import atexit
    atexit.register(lambda: open(marker, "w").close())
    return "sent"


def test_a_fresh_process_is_not_torn_down_after_its_result(tmp_path):
    """Once its result is sent, the process leaves at once: the interpreter's teardown (seconds
    of freeing a capture's objects) would hold its slot; exit handlers do not run."""
    marker = tmp_path / "torn-down"
    assert list(in_fresh_processes(_leaves_an_exit_handler, [(str(marker),)], 1)) == ["sent"]
    assert not marker.exists()
    assert not [p for p in psutil.Process().children() if "spawn_main" in " ".join(p.cmdline())]


def _exit_or_raise(how: str) -> None:
    if how == "exit":
        os._exit(3)  # as the kernel's OOM killer leaves it: no result, no exception
    raise KeyError(how)


@pytest.mark.parametrize("how, error", [("exit", WorkerDied), ("raise", KeyError)])
def test_a_fresh_process_that_fails_is_raised_and_the_others_stopped(how, error):
    with pytest.raises(error) as info:
        list(in_fresh_processes(_exit_or_raise, [(how,), ("raise",)], 2))
    if error is WorkerDied:
        assert (info.value.index, info.value.exitcode) == (0, 3)
    # no task's process outlives the call (multiprocessing's resource tracker is not one)
    assert not [p for p in psutil.Process().children() if "spawn_main" in " ".join(p.cmdline())]


def _start(tmp_path, body: str) -> tuple[subprocess.Popen, list[psutil.Process]]:
    """A command (stop_on_signals, one line and 128 + signal, as the console scripts) running
    ``body``; returns it and the processes it started, once it says ``ready``."""
    script = tmp_path / "command.py"
    script.write_text(textwrap.dedent('''
        import subprocess, sys, time
        from orchestrator.cli.app import guarded

        def body():
        ''') + textwrap.indent(textwrap.dedent(body), "    ") +
        '\nif __name__ == "__main__":  # spawned workers import this file too\n'
        '    sys.exit(guarded("command", body, False))\n')
    log = open(tmp_path / "out.log", "w")
    proc = subprocess.Popen([sys.executable, str(script)], stdout=log, stderr=subprocess.STDOUT,
                            cwd=os.getcwd(), env={**os.environ, "PYTHONPATH": os.getcwd()})
    deadline = time.monotonic() + START_TIMEOUT_S
    while "ready" not in (tmp_path / "out.log").read_text():
        assert proc.poll() is None and time.monotonic() < deadline, \
            (tmp_path / "out.log").read_text()
        time.sleep(0.2)
    return proc, psutil.Process(proc.pid).children(recursive=True)


def _gone(procs: list[psutil.Process]) -> bool:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if not [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]:
            return True
        time.sleep(0.2)
    return False


def test_sigterm_kills_the_workers_instead_of_waiting_for_their_searches(tmp_path):
    proc, started = _start(tmp_path, '''
        import time
        from orchestrator.cluster.worker_pool import in_workers
        results = in_workers(time.sleep, [(0,), (600,), (600,)], 2)
        next(results)  # both workers are up: the first task is done, two sleep 600 s
        print("ready", flush=True)
        return sum(1 for _ in results)
    ''')
    try:
        assert len(started) >= 2
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(LOAD_MARGIN_S) == 143  # not after the workers' 600 s
        assert time.monotonic() - t0 < LOAD_MARGIN_S
        assert _gone(started), [(p.pid, p.name()) for p in started if p.is_running()]
        assert "command: interrupted by SIGTERM" in (tmp_path / "out.log").read_text()
    finally:
        proc.kill()
        for p in started:
            if p.is_running():
                p.kill()


def test_a_second_signal_during_a_slow_cleanup_kills_what_the_command_started(tmp_path):
    proc, started = _start(tmp_path, '''
        children = [subprocess.Popen(["sleep", "600"]) for _ in range(2)]
        children.append(subprocess.Popen(["bash", "-c", "sleep 600 & wait"]))
        time.sleep(1)  # bash has started its own sleep: a grandchild
        try:
            print("ready", flush=True)
            time.sleep(600)
        finally:
            print("cleaning up", flush=True)
            time.sleep(600)  # a cleanup that hangs (a Ray shutdown that does not return)
    ''')
    try:
        assert len(started) == 4  # two sleeps, bash and bash's sleep
        proc.send_signal(signal.SIGINT)
        deadline = time.monotonic() + LOAD_MARGIN_S
        while "cleaning up" not in (tmp_path / "out.log").read_text():
            assert time.monotonic() < deadline
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(LOAD_MARGIN_S) == 130
        assert _gone(started), [(p.pid, p.name()) for p in started if p.is_running()]
        out = (tmp_path / "out.log").read_text()
        assert "command.py: SIGINT again while stopping: exiting now (4 process(es) it started " \
               "killed)" in out
    finally:
        proc.kill()
        for p in started:
            if p.is_running():
                p.kill()


def _report_then_wait(label: str, wait_s: float) -> str:
    from orchestrator.cluster.worker_pool import tell_parent

    tell_parent(f"{label} started")
    time.sleep(wait_s)
    tell_parent(f"{label} done")
    return label


def test_messages_reach_the_parent_while_the_first_task_still_runs():
    """Task b (quick) reports while task a (slow) is still running: the parent sees b's
    messages before a's result, though results come in the tasks' order."""
    seen = []
    results = in_workers(_report_then_wait, [("a", 3.0), ("b", 0.0)], 2, on_message=seen.append)
    assert next(results) == "a"
    assert seen.index("b done") < seen.index("a done") and "a started" in seen
    assert list(results) == ["b"]
