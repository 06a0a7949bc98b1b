"""The pool of worker processes a study's independent searches run in (fit_search's axes):
results in submission order, and no worker outlives the call.

A worker runs one search for minutes (a 70B probe captures and dry-runs a model), so on any
exit but the normal one (a signal, a search that raised) the other workers are not waited
for: they are killed by pid before the pool is shut down. Workers are spawned (not forked): a
capture patches torch process-wide, and a forked copy of a driver holding Ray's threads
would not be safe.
"""
from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor


def in_workers(fn: Callable, tasks: list[tuple], num_workers: int) -> Iterator:
    """``fn(*task)`` of every task, in ``num_workers`` spawned processes, yielded in the
    tasks' order as each is ready; ``fn`` must be importable by name (module level)."""
    pool = ProcessPoolExecutor(num_workers, mp_context=multiprocessing.get_context("spawn"))
    try:
        futures = [pool.submit(fn, *task) for task in tasks]
        for future in futures:
            yield future.result()
    except BaseException:
        for proc in list(pool._processes.values()):  # the pool's own table of its workers
            proc.kill()
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
