"""The pool of local worker processes independent work runs in (fit_search's axes, a mesh
job's roles recorded at once: orchestrator/run/roles.py): results in submission order, messages from the tasks as they are sent (a probe's progress
line the moment it is done, not when its whole search ends), and no worker outlives the call.

A worker runs one task for minutes (a 70B probe captures and dry-runs a model), so on any
exit but the normal one (a signal, a search that raised) the other workers are not waited
for: they are killed by pid before the pool is shut down. Workers are spawned (not forked): a
capture patches torch process-wide, and a forked copy of a driver holding Ray's threads
would not be safe.
"""
from __future__ import annotations

import multiprocessing
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
               on_message: Callable = lambda message: None,
               fresh_process: bool = False) -> Iterator:
    """``fn(*task)`` of every task, in ``num_workers`` spawned processes, yielded in the
    tasks' order as each is ready; ``fn`` must be importable by name (module level). What a
    task sends with ``tell_parent`` reaches ``on_message`` in this process while it waits.
    ``fresh_process``: each task in a process of its own (its memory is its own: a task's
    peak is not raised by what the one before left)."""
    spawn = multiprocessing.get_context("spawn")
    queue = spawn.SimpleQueue()  # handed to each worker as it starts (it cannot be an argument)
    pool = ProcessPoolExecutor(num_workers, mp_context=spawn, initializer=_attach,
                               initargs=(queue,), max_tasks_per_child=1 if fresh_process else None)

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
