"""Driver-side project exceptions (rank-side ones live in actors/errors.py)."""
from actors.errors import TracefleetError


class ClusterError(TracefleetError):
    """Ray could not be reached, or could not give us the resources or actors a run needs.

    The message says what was requested, what the cluster has, and which timeout expired.
    """


class SnapshotError(TracefleetError):
    """A memory snapshot file cannot be read: missing, not a pickle, not a snapshot, or holding
    a type a snapshot never holds (refused unread). The message names the file."""

    def __init__(self, path, message: str):
        self.path, self.detail = str(path), message
        super().__init__(f"{self.path}: {message}")

    def __reduce__(self):
        return type(self), (self.path, self.detail)


class ResultsError(TracefleetError):
    """A results file (a sweep's row, a run's summary.json) is cut or corrupt; the message
    names the file."""


# The exit status of every console script on a user error (a bad config, a bad trace, a path
# that cannot be read): the studies need it too, to sum up a sweep (orchestrator/studies/sweep.py).
USER_ERROR_EXIT = 2
