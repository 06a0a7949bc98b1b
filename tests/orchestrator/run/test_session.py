"""ReplaySession's reuse decision (no Ray needed for the paths that drop the actors)."""
from __future__ import annotations

from orchestrator.run.session import ReplaySession
from orchestrator.cluster.rank_result import Result


class _Group:
    workers = []
    num_shutdowns = 0
    graceful_s = None

    def shutdown(self, graceful_timeout_s: float = 5.0):
        self.num_shutdowns += 1
        self.graceful_s = graceful_timeout_s


def _kept(session: ReplaySession, group) -> ReplaySession:
    session._group, session._group_key = group, ("key",)
    return session


def test_actors_are_dropped_after_a_failed_or_missing_rank():
    for results in ([Result(0, "ok", {"status": "ok"}), Result(1, "ok", {"status": "failed"})],
                    [Result(0, "ok", {"status": "ok"}), Result(1, "timeout")],
                    [Result(0, "died")],
                    None):  # the replay never started
        group = _Group()
        session = _kept(ReplaySession(), group)
        session.release(group, results, timeout_s=1.0)
        assert group.num_shutdowns == 1 and session._group is None
        # no results (the wait was cut short: a signal, an error): killed without waiting on
        # actors that may still be mid-replay; else they get their polite shutdown first
        assert group.graceful_s == (0.0 if results is None else 5.0)


def test_a_group_the_session_does_not_keep_is_shut_down():
    kept, other = _Group(), _Group()
    session = _kept(ReplaySession(), kept)
    session.release(other, [Result(0, "ok", {"status": "ok"})], timeout_s=1.0)
    assert other.num_shutdowns == 1 and kept.num_shutdowns == 0 and session._group is kept
