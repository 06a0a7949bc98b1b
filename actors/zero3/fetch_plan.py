"""Build one rank's ZeRO-3 plan from its trace and the config (pure: no torch, no comm)."""
from __future__ import annotations

from dataclasses import dataclass

from actors.errors import ConfigError, ReplayError
from actors.trace.liveness import Liveness
from actors.trace.model import Trace
from actors.zero3.config import Zero3Config
from actors.zero3.leaves import granularities
from actors.zero3.markers import backward_windows
from actors.zero3.modules import BWD, UPDATE, ModuleTree, build_tree, op_module, phases
from actors.zero3.params import Param, discover_params, params_by_ref
from actors.zero3.fetch_schedule import Home, Plan, add_prefetch, simulate, uncovered_uses
from actors.zero3.fetch_strategies import STRATEGIES, Context, orphan_windows


@dataclass
class Zero3Plan:
    """Everything the runtime executes and the report describes."""

    plan: Plan
    params: list[Param]
    home_of: dict[int, Home]  # suid -> home
    tree: ModuleTree
    world: int


def build_plan(trace: Trace, liveness: Liveness, cfg: Zero3Config, world: int,
               marks: list[tuple[int, str, str]]) -> Zero3Plan:
    """The fetch/release plan of ``cfg.strategy`` on ``trace`` for a ``world``-rank job;
    ``marks`` are the trace's backward markers (actors/zero3/markers.py)."""
    _refuse_zero3_trace(trace, cfg)
    params = discover_params(trace, liveness)
    if not params:
        raise ReplayError(f"{trace.path}: zero3.strategy={cfg.strategy} found no parameter to "
                          "partition (parameters are storages read in forward and updated by "
                          "the optimizer in the same trace; a trace without an optimizer step, "
                          "or one recorded under ZeRO-3, has none): use zero3.strategy=none")
    mapping = {name: params_by_ref(params, refs, cfg.modules_by.value, name)
               for name, refs in (cfg.modules or {}).items()}
    tree = build_tree(trace, params, backward_windows(marks), mapping)
    steps = [(s.first, s.end) for s in trace.steps] or [(0, len(trace.ops))]
    ctx = Context(params, tree, phases(trace), steps, cfg, has_markers=bool(marks))
    strategy = STRATEGIES[cfg.strategy](ctx)
    home_of = strategy.homes()
    windows = strategy.windows(home_of)
    windows += orphan_windows(ctx, home_of, windows)
    for w in windows:
        w.backward = w.start < len(trace.ops) and ctx.phase[w.start] == BWD
    plan = simulate(windows, len(trace.ops), world, strategy.split)
    plan.homes = list({id(h): h for h in home_of.values()}.values())
    plan.leaves = strategy.leaves
    if cfg.prefetch:
        add_prefetch(plan, world, cfg.prefetch_bucket_size, cfg.max_live_parameters)
    if cfg.hpz_partition_size > 1:
        _drop_secondary_before_update(plan, ctx)
    bad = uncovered_uses(plan, params)
    if bad:  # a planning bug, not a user error: the op would silently allocate the parameter
        i, p = bad[0]
        raise ReplayError(f"{trace.path}: zero3 plan leaves {p} unfetched at op {i} "
                          f"(node {trace.ops[i].node_id} {trace.ops[i].name}); "
                          f"{len(bad)} such uses")
    return Zero3Plan(plan, params, home_of, tree, world)


def _drop_secondary_before_update(plan: Plan, ctx: Context) -> None:
    """hpZ's node-local copies serve the backward only: dropped when the update starts (the
    optimizer changes the parameters), or at the end of the step window."""
    for first, end in ctx.steps:
        b = next((i for i in range(first, end) if ctx.phase[i] == UPDATE), end)
        plan.events.setdefault(b, []).insert(0, ("drop_secondary", None))


def _refuse_zero3_trace(trace: Trace, cfg: Zero3Config) -> None:
    """A trace recorded under ZeRO-3 already fetches its parameters (all-gathers inside module
    forwards, from their pre-forward hooks): emulating on top would fetch them twice."""
    inside = sum(1 for op in trace.ops if op.collective is not None
                 and op.collective.kind == "all_gather_into_tensor" and op_module(op) is not None)
    if inside:
        raise ConfigError(f"{trace.path}: looks recorded under ZeRO-3 ({inside} all-gathers run "
                          f"inside module forwards); zero3.strategy={cfg.strategy} would fetch "
                          "its parameters a second time: replay it with zero3.strategy=none")


def module_report(z: Zero3Plan, threshold: int) -> list[dict]:
    """Per module owning parameters: name, parameters, elements, leaf or not, DeepSpeed's
    granularity (None where the rule never makes it a leaf), fetch windows."""
    gran = granularities(z.tree) if threshold > 0 or z.plan.leaves else {}
    rows = []
    for name in sorted(z.tree.modules):
        m = z.tree.modules[name]
        sub = z.tree.subtree_params(name)
        if not sub:
            continue
        g = gran.get(name)
        rows.append({"module": m.label, "num_params": len(m.own),
                     "numel": sum(p.numel for p in m.own), "subtree_numel": sum(p.numel for p in sub),
                     "leaf": name in z.plan.leaves,
                     "granularity": g if g is not None and g < 2**62 else None,
                     "num_forward_runs": len(m.forward), "num_backward_runs": len(m.backward)})
    return rows
