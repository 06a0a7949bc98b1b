"""Where a finished result goes: a list of sinks, each handed the result, as Ray Train hands
its results to callbacks.

A replay run (orchestrator/run/sinks.py) and a prediction (orchestrator/studies/
prediction_sinks.py) hand their result to each sink twice, in the list's order: ``write`` once
the result is whole (files, the console table, a page), then ``close`` once every sink wrote
and the result's own timings are final (a summary rewritten with them, a file that lists the
others, the outputs listing the eye lands on last). A sink that raises stops the sinks after
it: a file written at ``close`` is there only when everything written before it is.
"""
from __future__ import annotations

from typing import Generic, Sequence, TypeVar

R = TypeVar("R")


class Sink(Generic[R]):
    """A sink of results of type ``R``; each step does nothing unless a sink says otherwise."""

    def write(self, result: R) -> None:
        """The result is whole: write or show it."""

    def close(self, result: R) -> None:
        """Every sink has written and the result's timings are final."""


def write_all(sinks: Sequence[Sink[R]], result: R) -> None:
    """Hand ``result`` to each sink's ``write``, in order."""
    for sink in sinks:
        sink.write(result)


def close_all(sinks: Sequence[Sink[R]], result: R) -> None:
    """Hand ``result`` to each sink's ``close``, in order."""
    for sink in sinks:
        sink.close(result)
