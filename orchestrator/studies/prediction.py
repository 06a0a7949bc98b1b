"""One prediction of ``tracefleet-predict`` as a typed record: ``Prediction``, what
``predict()`` returns and ``prediction.json`` holds.

The fields are declared in ``prediction.json``'s key order: ``to_dict`` is that file's object
(``orjson`` writes it as it is), ``from_dict`` reads one back, refusing a field that is
missing or not what its name says with a ResultsError naming the file and the field.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from actors.choices import Choice
from orchestrator.errors import ResultsError
from orchestrator.outputs import PREDICTION_JSON
from orchestrator.results import read_json

BREAKDOWN_OF = "the accounted peak (bytes of the storages held, by category)"


class Verdict(Choice):
    """Whether the job fits the target."""

    fits = "fits"  # headroom above the error band
    too_close = "too_close"  # fits as predicted, but the headroom is inside the error band
    oom = "oom"  # the predicted reserved peak does not fit the usable capacity


@dataclass
class Prediction:
    """A training job's predicted memory on a target GPU and what the figures rest on. The
    figures are of ``rank``, the rank with the largest predicted reserved peak."""

    # the caching allocator model's peaks for the target (actors/replay/memory/reserved_model.py)
    predicted_allocated_peak_bytes: int
    predicted_reserved_peak_bytes: int
    usable_capacity_bytes: int  # the target's memory less what no tensor shows (context, NCCL)
    headroom_bytes: int  # usable capacity minus the reserved peak (negative: does not fit)
    verdict: str  # a Verdict: fits, too_close (headroom inside the error band) or oom
    error_band: float  # the prediction's relative error (0.03: 3% of the reserved peak)
    breakdown: dict[str, int]  # the accounted peak's bytes by category (parameters, ...)
    peak_op: dict | None  # the op at the accounted peak (node id, name, hook)
    world_size: int  # the job's number of GPUs
    workload: dict  # the workload's name and config, or its name and the given trace.dir
    error_band_source: str  # where error_band's value comes from
    accounted_peak_bytes: int  # the bytes of the storages held at the peak (no allocator)
    breakdown_of: str  # what breakdown splits (BREAKDOWN_OF)
    breakdown_help: dict[str, str]  # per category in breakdown, what it holds
    num_predicted_ooms: int  # the allocator model's out-of-memory events
    num_alloc_retries: int  # the allocator model's retries (cache freed to fit a block)
    host_peak_bytes: int  # host offload: the peak the job keeps in host memory (not above)
    coverage: float  # the share of the trace's ops that ran as recorded
    num_dropped_ops: int  # recorded ops the loader left out (outside every step window)
    num_orphan_ops: int  # ops under no step range, left out
    not_run_ops: list[dict]  # what did not run as recorded, with its bytes
    target: dict  # the target's figures (device memory, context, NCCL, usable, defaults)
    zero3_emulation: dict | None  # the ZeRO-3 emulation's config, None without one
    rank: int  # the rank the figures are of
    ranks: list[int]  # the ranks whose traces were read
    num_distinct_traces: int  # how many distinct traces were dry-run (one replay each)
    ranks_per_trace: dict[str, int]  # a replayed rank (as text) -> how many ranks it stands for
    mesh: dict | None  # N-D jobs: the degrees, ranks per role, the worst rank's role
    capture: dict | None  # the capture's facts (folder, reused, device, seconds); None: given
    kernel_dispatch: list  # ops the capture ran as the target GPU's kernels, not the CPU's
    timings_s: dict[str, float]  # capture_s, replay_s, total_s (and snapshot_s when written)
    memory_timeline: dict | None  # the allocator model's timeline of ``rank`` (the page's plot)
    snapshots: dict[str, str]  # rank (as text) -> its snapshot file, beside prediction.json
    per_role: dict[str, dict]  # each distinct trace's figures, by its role on a mesh
    # the timelines' plot file, beside prediction.json; None (and no key) when not written
    memory_timelines: str | None = None

    @property
    def fits(self) -> bool:
        """True only for ``fits``: ``too_close`` fits as predicted but within the error band."""
        return self.verdict == Verdict.fits

    def to_dict(self) -> dict:
        """``prediction.json``'s object: every field in declaration order (the same objects,
        not copies); ``memory_timelines`` only once the timelines were written."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if self.memory_timelines is None:
            del out["memory_timelines"]
        return out

    @classmethod
    def from_dict(cls, data, path: Path | str = PREDICTION_JSON) -> "Prediction":
        """The prediction ``data`` (``prediction.json``'s object, read from ``path``) holds;
        ResultsError naming the file and the first field that is missing, unknown or not of
        its declared type."""
        if not isinstance(data, dict):
            raise ResultsError(f"{path}: a prediction is a JSON object; this file holds a "
                               f"{type(data).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = [k for k in data if k not in names]
        if unknown:
            raise ResultsError(f"{path}: {unknown[0]}: not a field of a prediction (one "
                               "written by another tracefleet version?)")
        for f in dataclasses.fields(cls):
            if f.name not in data:
                if f.default is dataclasses.MISSING:
                    raise ResultsError(f"{path}: {f.name}: missing")
            elif not _is(f.type, data[f.name]):
                raise ResultsError(f"{path}: {f.name}: {_shown(data[f.name])} is not "
                                   f"{f.type}")
        verdicts = [v.value for v in Verdict]
        if data["verdict"] not in verdicts:
            raise ResultsError(f"{path}: verdict: {_shown(data['verdict'])} is not one of "
                               f"{', '.join(verdicts)}")
        return cls(**data)


def read_prediction(path: Path) -> Prediction:
    """The prediction in ``path`` (a ``prediction.json``), checked (``Prediction.from_dict``)."""
    return Prediction.from_dict(read_json(path, "a prediction"), path)


# a declared type's JSON shapes (``from __future__`` keeps the annotations as text)
_SHAPES = {"int": lambda v: type(v) is int, "float": lambda v: type(v) in (int, float),
           "str": lambda v: isinstance(v, str), "dict": lambda v: isinstance(v, dict),
           "list": lambda v: isinstance(v, list), "None": lambda v: v is None}


def _is(declared: str, value) -> bool:
    """Whether ``value`` has one of the shapes of ``declared`` (``dict[str, int] | None``)."""
    return any(_SHAPES[part.strip().split("[")[0]](value) for part in declared.split("|"))


def _shown(value) -> str:
    text = repr(value) if not isinstance(value, (dict, list)) else \
        f"a {'JSON object' if isinstance(value, dict) else 'list'}"
    return text if len(text) <= 40 else text[:37] + "..."
