"""The status of a rank, a run, a table row: one closed set, written and compared everywhere.

Ranks write their status in their report (actors/replay/report.py, actors/rank_actor.py, the
same values); the driver aggregates them into the run's (orchestrator/run/aggregate.py), and
every row of a results table carries one. A ``str`` Enum, so ``status == RunStatus.ok`` also
holds for the plain strings read back from JSON, CSV or parquet.
"""
from __future__ import annotations

from actors.choices import Choice


class RunStatus(Choice):
    """How a replay (one rank's, a run's) or a table row ended."""

    ok = "ok"  # every iteration ran
    oom = "oom"  # the emulated device ran out of memory
    failed = "failed"  # an error (a rank's, a search's, a point's)
    timeout = "timeout"  # a bound ran out (the replay's, the grace after a peer failed)
    invalid = "invalid"  # rows only: the config or traces were refused before any replay
    interrupted = "interrupted"  # a signal (SIGINT, SIGTERM) stopped the run: run it again


# What a replay can end with (a rank's or a run's status); ``invalid`` is a row's only, and
# ``interrupted`` a run's that did not end (a sweep runs such a point again).
REPLAY_STATUSES = (RunStatus.ok, RunStatus.oom, RunStatus.failed, RunStatus.timeout)
# Worst first: the root cause of a run. An OOM is the most specific diagnosis and usually the
# cause of the others; a timeout is most often collateral (orchestrator/run/aggregate.py).
FAILURE_PRECEDENCE = (RunStatus.oom, RunStatus.failed, RunStatus.timeout)
# A replay that ended in one of these measured what it was asked to (an OOM is an answer).
ANSWERED = (RunStatus.ok, RunStatus.oom)
