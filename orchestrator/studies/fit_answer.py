"""One axis' answer of ``experiment=fit_search`` (orchestrator/studies/fit_search.py, and
fit_layout.py for the layout axis); fit_search_report.py writes it out."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class AxisAnswer:
    """The outcome of one axis' search."""

    axis: str
    best: int | str | None  # the best candidate seen to fit; None: none did
    # the nearest more ambitious candidate seen not to fit (None: the search ran to the end of
    # its candidates, or was stopped)
    first_failing: int | str | None
    num_probes: int
    reason: str | None  # why the answer is not a proven boundary, None when it is
    probes: list[dict] = field(default_factory=list)  # the probe records, in probe order
    # the layout axis: every cheaper layout, with why it does not fit (fit_layout.py)
    others: list[dict] = field(default_factory=list)
