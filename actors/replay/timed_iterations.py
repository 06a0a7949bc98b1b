"""How far a median iteration time can be trusted, and when to stop timing iterations.

The interval is the distribution-free (order-statistic) confidence interval of the median:
for sorted samples x(1) <= ... <= x(n), [x(j), x(n+1-j)] covers the true median with
probability 1 - 2 P(B <= j-1), B ~ Binomial(n, 1/2), whatever the distribution (iteration
times are skewed: a preempted iteration is far slower, never far faster). j is the largest
that keeps that probability >= the confidence asked for, so the interval's own level (reported)
is at least that; with fewer than 6 samples no 95% interval exists (n=5: [min, max] is 93.8%).

The stopping rule (``replay.min_time_s > 0``) goes on timing iterations past ``replay.iters``
until the measured time reaches ``min_time_s`` and the interval is within ``ci_target`` of the
median, or ``max_iters`` (timeit's autorange, with the interval as its criterion). Ranks replay
collectives in lockstep: a rank that stopped early would leave its peers blocked in their next
collective, so the rule must decide the same on every rank. It does: each measured iteration's
time is all-reduced (MAX) over the world group, outside the timed window, so every rank sees
the same series, the slowest rank's per iteration (the headline's statistic), and applies the
same deterministic rule to it. Without process groups (compute mode) a rank decides alone.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from math import comb

CONFIDENCE = 0.95
METHOD = ("distribution-free order-statistic interval of the median "
          "(binomial: [x(j), x(n+1-j)] of the sorted iteration times)")


@dataclass(frozen=True)
class MedianInterval:
    """The median of some samples and its confidence interval."""

    median: float
    low: float
    high: float
    level: float  # the interval's exact coverage, >= the confidence asked for
    num_samples: int

    @property
    def rel_half_width(self) -> float:
        """The larger distance from the median to an end, relative to the median."""
        if self.median <= 0:
            return float("inf")
        return max(self.median - self.low, self.high - self.median) / self.median


def order_statistic_rank(n: int, confidence: float = CONFIDENCE) -> tuple[int, float] | None:
    """``(j, level)``: the largest 1-based j with P(B <= j-1) <= (1-confidence)/2 for
    B ~ Binomial(n, 1/2), and the interval's coverage 1 - 2 P(B <= j-1); None if even
    [min, max] is below ``confidence``."""
    tail, cumulative, best = (1 - confidence) / 2, 0.0, None
    for j in range(1, n // 2 + 1):
        cumulative += comb(n, j - 1) / 2 ** n  # P(B <= j-1)
        if cumulative > tail:
            break
        best = (j, 1 - 2 * cumulative)
    return best


def median_interval(samples, confidence: float = CONFIDENCE) -> MedianInterval | None:
    """The median of ``samples`` with its order-statistic confidence interval (module doc);
    None when there are too few samples for one."""
    xs = sorted(float(x) for x in samples)
    found = order_statistic_rank(len(xs), confidence)
    if found is None:
        return None
    j, level = found
    return MedianInterval(statistics.median(xs), xs[j - 1], xs[len(xs) - j], level, len(xs))


def interval_fields(samples) -> dict:
    """The timing figures reported beside a median iteration time: the number of timed
    iterations, min, max and the 95% interval of the median (None where it does not exist)."""
    samples = list(samples)
    ci = median_interval(samples)
    return {"num_timed_iterations": len(samples),
            "iteration_time_min_s": min(samples, default=None),
            "iteration_time_max_s": max(samples, default=None),
            "iteration_time_ci_low_s": ci.low if ci else None,
            "iteration_time_ci_high_s": ci.high if ci else None,
            "iteration_time_ci_level": ci.level if ci else None}


class StopRule:
    """Decides after each timed iteration whether timing stops (module doc).

    ``share(seconds) -> seconds`` turns this rank's iteration time into the one every rank
    decides on (the max over the world group); None decides on this rank's own time.
    """

    def __init__(self, iters: int, min_time_s: float = 0.0, ci_target: float = 0.05,
                 max_iters: int | None = None, share=None):
        self.iters = iters
        self.min_time_s = min_time_s
        self.ci_target = ci_target
        self.max_iters = max(iters, max_iters or iters)
        self.adaptive = min_time_s > 0
        self.share = share if self.adaptive else None
        self.series: list[float] = []  # the times the decision is taken on
        self.reason: str | None = None  # why timing stopped, once it did

    @property
    def planned(self) -> int:
        """The most timed iterations this rule can run."""
        return self.max_iters if self.adaptive else self.iters

    def done(self, elapsed_s: float) -> bool:
        """Record one timed iteration; True when timing stops here (the same on every rank)."""
        self.series.append(self.share(elapsed_s) if self.share is not None else elapsed_s)
        n = len(self.series)
        if n < self.iters:
            return False
        if not self.adaptive:
            self.reason = "replay.iters"
        elif sum(self.series) >= self.min_time_s and self._within_target():
            self.reason = f"interval within +-{self.ci_target:.0%}"
        elif n >= self.max_iters:
            self.reason = "replay.max_iters (interval not within target)"
        return self.reason is not None

    def _within_target(self) -> bool:
        ci = median_interval(self.series)
        return ci is not None and ci.rel_half_width <= self.ci_target


def world_max(device):
    """A ``share`` for StopRule: the max of a float over the default process group (a CPU
    tensor on gloo; on the rank's GPU with NCCL)."""
    import torch
    import torch.distributed as dist

    where = device if device.type == "cuda" else torch.device("cpu")

    def share(seconds: float) -> float:
        t = torch.tensor([seconds], dtype=torch.float64, device=where)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    return share
