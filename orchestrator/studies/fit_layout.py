"""fit_search's layout axis: on the job's GPUs, the cheapest mesh (dp_shard, tp, pp, cp) that
fits, and why each cheaper one does not.

Candidates are every ``(tp, pp, cp)`` of ``fit_search.layout_tp / layout_pp / layout_cp``
whose product divides world_size (dp_shard takes the rest, dp_replicate stays the job's),
ordered cheapest first by what the split costs in communication: the model-parallel degree
``tp x pp x cp`` (FSDP alone first), then fewer pipeline stages (bubbles and a schedule), then
less context parallel (a ring per layer), tensor parallel (within a node) breaking the tie.
They are walked in that order: a layout the recipe cannot run is refused with its
ConfigError's reason (no prediction), the others predicted until one ``fits``; the walk makes
at most ``fit_search.max_probes`` predictions. Fitting is not assumed monotone here: a more
costly layout is not proved to fit by a cheaper one failing.
"""
from __future__ import annotations

import copy
import dataclasses
import itertools

from actors.capture.workloads.mesh import ParallelismConfig, validate_parallelism
from actors.errors import ConfigError
from orchestrator.studies.fit_answer import AxisAnswer
from orchestrator.studies.fit_search_config import Axis, FitSearchRunConfig
from orchestrator.units import human_bytes


def layout_candidates(cfg: FitSearchRunConfig) -> list[dict]:
    """Every layout of the search, cheapest first (``{"tp", "pp", "cp"}``; see the module
    doc)."""
    fs, world = cfg.fit_search, cfg.world_size
    replicate = cfg.workload.parallelism.dp_replicate
    out = []
    for tp, pp, cp in itertools.product(sorted(set(fs.layout_tp)), sorted(set(fs.layout_pp)),
                                        sorted(set(fs.layout_cp))):
        if world % (tp * pp * cp * replicate) == 0:
            out.append({"tp": tp, "pp": pp, "cp": cp})
    return sorted(out, key=lambda c: (c["tp"] * c["pp"] * c["cp"], c["pp"], c["cp"], c["tp"]))


def with_layout(cfg: FitSearchRunConfig, layout: dict) -> FitSearchRunConfig:
    """``cfg`` whose workload runs on ``layout`` (dp_shard: the rest)."""
    out = copy.deepcopy(cfg)
    par = dataclasses.replace(out.workload.parallelism, dp_shard=-1, **layout)
    if par.pp == 1:
        par.pp_microbatches, par.pp_stages_per_rank = 0, 1
    out.workload.parallelism = ParallelismConfig(**dataclasses.asdict(par))
    return out


def describe(cfg: FitSearchRunConfig, layout: dict) -> str:
    """``dp_shard 16 x tp 8``: the layout's degrees above 1."""
    return with_layout(cfg, layout).workload.parallelism.describe(cfg.world_size)


def search_layout(cfg: FitSearchRunConfig, prober):
    """The layout axis' answer: the cheapest layout that fits, and in ``others`` every cheaper
    one with why it does not."""
    probes: list[dict] = []
    others: list[dict] = []
    for layout in layout_candidates(cfg):
        name = describe(cfg, layout)
        try:
            validate_parallelism(with_layout(cfg, layout).workload, cfg.world_size)
        except ConfigError as e:
            others.append({"layout": name, "verdict": "refused", "reason": str(e)})
            continue
        if len(probes) == cfg.fit_search.max_probes:
            return AxisAnswer(str(Axis.layout), None, None, len(probes),
                              f"stopped after fit_search.max_probes={len(probes)}", probes,
                              others)
        if prober.fits(Axis.layout, layout, probes, label=name):
            return AxisAnswer(str(Axis.layout), name, others[-1]["layout"] if others else None,
                              len(probes), None, probes, others)
        p = probes[-1]
        others.append({"layout": name, "verdict": p["verdict"],
                       "reason": f"reserved {human_bytes(p['predicted_reserved_peak_bytes'])} "
                                 f"of {human_bytes(p['usable_capacity_bytes'])} usable "
                                 f"(headroom {human_bytes(p['headroom_bytes'])})"})
    return AxisAnswer(str(Axis.layout), None, others[-1]["layout"] if others else None,
                      len(probes), "no candidate layout fits" if probes else
                      "no candidate layout can run", probes, others)
