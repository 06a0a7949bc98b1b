"""Project exceptions. User errors carry a precise message; the CLIs print it without a traceback."""
import traceback
from contextlib import contextmanager
from pathlib import Path


class TracefleetError(Exception):
    """Base class of every error tracefleet reports to the user."""


class TraceError(TracefleetError):
    """A trace file is unreadable, of an unknown schema, or malformed.

    The message names the file, the node id where known, and what was expected.
    """

    def __init__(self, path, message: str, node_id: int | None = None):
        self.path = str(path)
        self.node_id = node_id
        self.detail = message
        where = f"{self.path}" + (f", node {node_id}" if node_id is not None else "")
        super().__init__(f"{where}: {message}")

    def __reduce__(self):
        # Exception pickles as cls(*self.args), i.e. with the formatted message only; a
        # TraceError raised in a worker process must cross back with its three fields.
        return (type(self), (self.path, self.detail, self.node_id))


class ReplayError(TracefleetError):
    """A replay could not proceed (strict shape mismatch, unusable trace for the mode, ...)."""


class CollectiveTimeout(ReplayError, TimeoutError, RuntimeError):
    """A collective did not complete within its process group's timeout (a peer hung or is
    gone): torch raises a plain RuntimeError then, which this names by its kind (and still is,
    for callers that catch torch's)."""


class ConfigError(TracefleetError):
    """A configuration value is invalid or inconsistent with the traces."""


def describe(error: BaseException, phase: str | None = None, op=None) -> str:
    """One line naming a failure and its place, never empty:
    ``<Type>: <message> at node <id> <op> (phase <phase>)``.

    ``op`` is the trace op it stopped at (anything with ``node_id`` and ``name``), ``phase``
    what the rank was doing (load, rendezvous, compile, iteration). An exception that is not
    a project error is a defect somewhere: the innermost frame of its traceback is added, as
    its message alone can say nothing (``KeyError('')`` reads ``''``).
    """
    text = str(error).strip()
    text = text.splitlines()[0] if text else "(no message)"
    out = f"{type(error).__name__}: {text}"
    if op is not None:
        out += f" at node {op.node_id} {op.name}"
    if phase:
        out += f" (phase {phase})"
    if not isinstance(error, TracefleetError) and error.__traceback__ is not None:
        frame = traceback.extract_tb(error.__traceback__)[-1]
        out += f" [{'/'.join(Path(frame.filename).parts[-2:])}:{frame.lineno} in {frame.name}]"
    return out


@contextmanager
def writing(path, what: str):
    """Name ``path`` and ``what`` is written there in an OSError raised inside without a file
    name: a full disk fails a ``write`` with ``ENOSPC`` and no name, so the one-line error a
    user sees would not say which folder filled up."""
    try:
        yield
    except OSError as e:
        if e.filename is not None:
            raise
        raise OSError(e.errno, f"{e.strerror or e} (writing {what})", str(path)) from None
