"""The config of ``tracefleet-predict experiment=fit_search`` (orchestrator/fit_search.py).

``FitSearchConfig`` says which axes are searched and within which bounds; ``FitSearchRunConfig``
is tracefleet-predict's root config with it added. conf/experiment/fit_search.yaml puts the
latter in place of ``PredictConfig`` (OmegaConf re-types a node merged with a subclass of its
schema), so ``PredictConfig`` itself knows nothing of the search. The schema is registered in
Hydra's ConfigStore as ``SCHEMA_NAME`` by orchestrator/cli/schemas.py's ``register_all``.
"""
from __future__ import annotations

from dataclasses import dataclass

from actors.capture.workloads.checkpointing import ActivationCheckpointing
from actors.choices import Choice
from actors.config_fields import setting
from actors.errors import ConfigError
from orchestrator.config import Executor
from orchestrator.studies.predict import PredictConfig

SCHEMA_NAME = "fit_search_schema"
# Cheapest first: what each level recomputes in backward grows along the list.
AC_ORDER = (ActivationCheckpointing.none, ActivationCheckpointing.selective_op,
            ActivationCheckpointing.selective_layer, ActivationCheckpointing.full)


class Axis(Choice):
    """One knob of the job searched with the others held at the workload's values."""

    batch_size = "batch_size"  # the largest local batch (workload.batch_size) that fits
    seq_len = "seq_len"  # the longest sequence (workload.seq_len, a multiple of seq_len_step)
    world_size = "world_size"  # the fewest GPUs (world_size among world_sizes)
    activation_checkpointing = "activation_checkpointing"  # the cheapest AC level that fits
    # on world_size GPUs, the cheapest mesh (tp, pp, cp; dp_shard the rest) that fits
    # (orchestrator/studies/fit_layout.py); not searched unless named in fit_search.axes
    layout = "layout"


@dataclass
class FitSearchConfig:
    """What ``experiment=fit_search`` searches: one axis at a time, the best value whose
    prediction's verdict is ``fits`` (headroom above the error band), the other knobs at the
    workload's (and world_size's) values."""

    axes: list[Axis] = setting(factory=lambda: [a for a in Axis if a != Axis.layout], help=(
        "Axes searched, in this order (each from the composed job, not from another axis' "
        "answer); layout is not searched unless named here."))
    max_batch_size: int = setting(64, help=(
        "Largest local batch probed; the search doubles from workload.batch_size up to it, "
        "then bisects between the last value that fits and the first that does not."))
    max_seq_len: int = setting(131072, help="Longest sequence probed.")
    seq_len_step: int = setting(256, help=(
        "The granularity of the sequence search: every probed seq_len is a multiple of it (a "
        "workload.seq_len off the grid is rounded down)."))
    world_sizes: list[int] = setting(factory=list, help=(
        "Candidate GPU counts for the fewest-GPU search; empty: the powers of two from 1 up to "
        "world_size. Fitting is assumed monotone (more GPUs, smaller shards): the candidates "
        "are probed from world_size down by doubling steps, then bisected."))
    max_probes: int = setting(12, help=(
        "Bound on the predictions of one axis (a search stopped by it says so in its answer)."))
    layout_tp: list[int] = setting(factory=lambda: [1, 2, 4, 8], help=(
        "The layout axis' candidate tp degrees (up to a node's 8 GPUs): every (tp, pp, cp) of "
        "layout_tp, layout_pp and layout_cp whose product divides world_size, walked cheapest "
        "first (orchestrator/studies/fit_layout.py)."))
    layout_pp: list[int] = setting(factory=lambda: [1, 2, 4, 8], help=(
        "The layout axis' candidate pp degrees."))
    layout_cp: list[int] = setting(factory=lambda: [1], help=(
        "The layout axis' candidate cp degrees (by default [1]: cp is for long sequences)."))
    num_workers: int = setting(2, help=(
        "Processes searching axes side by side (each axis is a sequential search; the axes are "
        "independent). 1: one after another in this process. Each worker imports torch once "
        "(~2 s) and holds one trace at a time."))
    executor: Executor = setting(Executor.local, help=(
        "Where the axes run side by side: local, worker processes on this machine; ray, Ray "
        "tasks on the cluster at ray_address, spread over its nodes (one CPU each; each node "
        "keeps its own capture cache)."))
    ray_address: str | None = setting(None, help=(
        "executor=ray: the Ray cluster (host:port, or auto); null starts a local one for the "
        "search."))

    def validate(self, world_size: int | None) -> None:
        """ConfigError on bounds that leave nothing to search (before any capture)."""
        key = "fit_search"
        if not self.axes:
            raise ConfigError(f"{key}.axes is empty; expected one or more of "
                              f"{', '.join(a.value for a in Axis)}")
        for name in ("max_batch_size", "max_seq_len", "seq_len_step", "max_probes", "num_workers"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{key}.{name}={getattr(self, name)}; expected >= 1")
        if self.max_seq_len < self.seq_len_step:
            raise ConfigError(f"{key}.max_seq_len={self.max_seq_len} is below "
                              f"{key}.seq_len_step={self.seq_len_step}: no sequence to probe")
        for name in ("layout_tp", "layout_pp", "layout_cp"):
            if not getattr(self, name) or min(getattr(self, name)) < 1:
                raise ConfigError(f"{key}.{name}={list(getattr(self, name))}: expected one or "
                                  "more degrees >= 1")
        bad = [w for w in self.world_sizes if w < 1]
        if bad:
            raise ConfigError(f"{key}.world_sizes={list(self.world_sizes)}: {bad} not >= 1")
        if Axis.layout in self.axes and world_size is None:
            raise ConfigError(f"{key}.axes has layout but world_size is null: the layout search "
                              "splits the job's world_size=N GPUs")
        if Axis.world_size in self.axes and world_size is None:
            raise ConfigError(f"{key}.axes has world_size but world_size is null: the fewest-GPU "
                              "search starts from the job's world_size=N")

    def candidate_world_sizes(self, world_size: int) -> list[int]:
        """The GPU counts the fewest-GPU search may answer, ascending."""
        if self.world_sizes:
            return sorted(set(self.world_sizes))
        sizes, w = [], 1
        while w <= world_size:
            sizes.append(w)
            w *= 2
        return sizes if world_size in sizes else sizes + [world_size]


@dataclass
class FitSearchRunConfig(PredictConfig):
    """tracefleet-predict's root config with the fit search (experiment=fit_search)."""

    fit_search: FitSearchConfig = setting(factory=FitSearchConfig, help=(
        "What experiment=fit_search searches and within which bounds."))

    def validate(self) -> None:
        """PredictConfig's checks and the search's bounds; ConfigError otherwise."""
        super().validate()
        if self.trace.dir is not None:
            raise ConfigError("experiment=fit_search changes the workload and captures it: "
                              f"trace.dir={self.trace.dir!r} cannot be searched; give a "
                              "workload preset instead")
        self.fit_search.validate(self.world_size)

