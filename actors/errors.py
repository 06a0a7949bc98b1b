"""Project exceptions. User errors carry a precise message; the CLIs print it without a traceback."""


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


class ConfigError(TracefleetError):
    """A configuration value is invalid or inconsistent with the traces."""
