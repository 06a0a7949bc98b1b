"""Local worker processes that independent work runs in (fit_search's axes; a mesh job's roles
recorded at once, each in a process of its own: orchestrator/run/roles.py): results in
submission order, messages from the tasks as they are sent (a probe's progress line the moment
it is done, not when its whole search ends), and no worker outlives the call.

A worker runs one task for minutes (a 70B probe captures and dry-runs a model), so on any
exit but the normal one (a signal, a search that raised) the other workers are not waited
for: they are killed by pid before the pool is shut down. Workers are spawned (not forked): a
capture patches torch process-wide, and a forked copy of a driver holding Ray's threads
would not be safe.
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import sys
from multiprocessing import connection
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor


POLL_S = 0.2  # how often the parent looks for messages while it waits for a result
_to_parent = None  # in a worker: where tell_parent's messages go


def _attach(queue) -> None:
    global _to_parent
    _to_parent = queue


def tell_parent(message) -> None:
    """From inside a task of ``in_workers``: hand ``message`` (picklable) to the parent's
    ``on_message`` now; nothing outside a worker."""
    if _to_parent is not None:
        _to_parent.put(message)


def in_workers(fn: Callable, tasks: list[tuple], num_workers: int,
               on_message: Callable = lambda message: None) -> Iterator:
    """``fn(*task)`` of every task, in ``num_workers`` spawned processes, yielded in the
    tasks' order as each is ready; ``fn`` must be importable by name (module level). What a
    task sends with ``tell_parent`` reaches ``on_message`` in this process while it waits."""
    spawn = multiprocessing.get_context("spawn")
    queue = spawn.SimpleQueue()  # handed to each worker as it starts (it cannot be an argument)
    pool = ProcessPoolExecutor(num_workers, mp_context=spawn, initializer=_attach,
                               initargs=(queue,))

    def drain() -> None:
        while not queue.empty():
            on_message(queue.get())

    try:
        futures = [pool.submit(fn, *task) for task in tasks]
        for future in futures:
            while True:
                try:
                    result = future.result(timeout=POLL_S)
                    break
                except TimeoutError:
                    drain()
            drain()  # what the task sent before it returned
            yield result
    except BaseException:
        for proc in list(pool._processes.values()):  # the pool's own table of its workers
            proc.kill()
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        queue.close()


class WorkerDied(ChildProcessError):
    """A task's process ended without a result (killed by a signal, the kernel's OOM killer,
    an ``os._exit``); ``index`` is the task's, ``exitcode`` the process's."""

    def __init__(self, index: int, exitcode: int | None):
        super().__init__(f"task {index}'s process ended without a result (exit code {exitcode})")
        self.index, self.exitcode = index, exitcode


def _run_one(fn: Callable, task: tuple, send, queue) -> None:
    """In a fresh process: ``fn(*task)``'s result, or its exception, sent back once."""
    _attach(queue)
    try:
        outcome = (True, fn(*task))
    except BaseException as exc:  # noqa: BLE001 (the parent raises it)
        outcome = (False, exc)
    try:
        send.send(outcome)
    except Exception as exc:  # noqa: BLE001 (an unpicklable result or exception)
        send.send((False, RuntimeError(f"{type(exc).__name__}: {exc} (sending {outcome[1]!r})")))
    # Sent: leave without the interpreter's teardown, which frees every object one by one
    # (seconds after a 405B stage's capture) while the parent waits to start the next task
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _outcome(index: int, proc, receive) -> tuple[bool, object]:
    """What an ended (or ending) task's process sent: ``(ok, result or exception)``;
    `WorkerDied` when it sent nothing."""
    try:
        if receive.poll(0):
            return receive.recv()
        proc.join(POLL_S * 50)  # it ended: a result sent just before is readable now
        if receive.poll(0):
            return receive.recv()
        return False, WorkerDied(index, proc.exitcode)
    except EOFError:  # the process ended before it sent anything
        proc.join(POLL_S * 50)
        return False, WorkerDied(index, proc.exitcode)
    finally:
        proc.join()
        receive.close()


def in_fresh_processes(fn: Callable, tasks: list[tuple], num_workers: int,
                       on_message: Callable = lambda message: None) -> Iterator:
    """As ``in_workers``, each task in a spawned process of its own, ``num_workers`` at a time:
    its memory is its own (its peak is not raised by what a task before it left, and a
    bound on it is a bound on the task). A process that ends without a result raises
    `WorkerDied`. (Not ProcessPoolExecutor's ``max_tasks_per_child``: in Python 3.11 the
    pool can deadlock replacing a worker that ended, gh-115634.)"""
    spawn = multiprocessing.get_context("spawn")
    queue = spawn.SimpleQueue()
    running: dict[int, tuple] = {}  # task index -> (process, the end its result arrives at)
    outcomes: dict[int, tuple] = {}  # task index -> (ok, result or exception), until yielded
    started = 0

    def drain() -> None:
        while not queue.empty():
            on_message(queue.get())

    try:
        for index in range(len(tasks)):
            # a slot is filled as soon as any task ends, not when the one due next does: the
            # roles of a pipeline take 2-3 minutes each, a minute apart
            while index not in outcomes:
                while started < len(tasks) and len(running) < num_workers:
                    receive, send = spawn.Pipe(duplex=False)
                    proc = spawn.Process(target=_run_one, args=(fn, tasks[started], send, queue))
                    proc.start()
                    send.close()  # the child's end: only the child holds it now
                    running[started] = (proc, receive)
                    started += 1
                connection.wait([receive for _, receive in running.values()], POLL_S)
                drain()
                for ended in [i for i, (proc, receive) in running.items()
                              if receive.poll(0) or not proc.is_alive()]:
                    outcomes[ended] = _outcome(ended, *running.pop(ended))
            drain()
            ok, value = outcomes.pop(index)
            if not ok:
                raise value
            yield value
    except BaseException:
        for proc, _ in running.values():
            proc.kill()
        raise
    finally:
        for proc, receive in running.values():
            proc.join()
            receive.close()
        queue.close()
