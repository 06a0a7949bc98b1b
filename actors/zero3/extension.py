"""ZeRO-3 as a replay extension: partitioned parameters fetched and released around the ops,
their gradients reduce-scattered to shards and their optimizer state held as shards.

``zero3_extensions`` builds one when ``zero3.strategy`` is not ``none``; the rank actor and
the predictor hand it to the engine (``RankSession(..., extensions=lambda trace:
zero3_extensions(cfg, trace))``). It plans once against the compiled steps, owns
every parameter storage and every model state of a partitioned parameter (gradients,
optimizer state, update temporaries: the allocation policy leaves them alone), and turns each
boundary's events into one hook.
"""
from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from actors.errors import ConfigError
from actors.replay.extension_contract import ReplayContext, ReplayExtension
from actors.zero3.config import GradAccumDtype, StatesLayout, Zero3Config
from actors.zero3.deepspeed_layout import deepspeed_buffers, update_windows
from actors.zero3 import metrics as zero3_metrics
from actors.zero3.markers import read_backward_marks
from actors.zero3.states_plan import GRAD, STATE, TEMP, StatesPlan, find_model_states, \
    plan_states, views_of
from actors.zero3.modules import UPDATE, phases
from actors.zero3.fetch_plan import Zero3Plan, build_plan, module_report
from actors.zero3.fetch_runtime import Zero3Runtime
from actors.zero3.states_runtime import ModelStatesRuntime


class Zero3Extension(ReplayExtension):
    """Partition the trace's parameters over ``world`` ranks and replay ``cfg.strategy``."""

    name = "zero3"

    def __init__(self, cfg: Zero3Config, marks: list[tuple[int, str, str]]):
        self.cfg = cfg
        self.marks = marks  # backward markers (actors/zero3/markers.py)
        self.z: Zero3Plan | None = None
        self.runtime: Zero3Runtime | None = None
        self.states: StatesPlan | None = None
        self.states_runtime: ModelStatesRuntime | None = None
        self.context: ReplayContext | None = None  # the replay's facilities, set by attach

    def attach(self, ctx: ReplayContext) -> None:
        group = None
        if self.cfg.world_size is not None:
            world = self.cfg.world_size  # emulated: no communication
        elif ctx.comm is not None:
            group = ctx.comm.groups.handle("0")
            world = group.size()
        else:  # compute mode: the trace's world, emulated
            world = trace_world_size(ctx.trace)
        hpz = self.cfg.hpz_partition_size
        if world % hpz:
            raise ConfigError(f"zero3.hpz_partition_size={hpz} does not divide the world size "
                              f"{world}; expected the ranks per node (e.g. GPUs per node)")
        self.z = build_plan(ctx.trace, ctx.liveness, self.cfg, world, self.marks)
        hpz_group = _node_group(ctx.rank, world, hpz, ctx.cfg.collective_timeout_s) \
            if group is not None and hpz > 1 else None
        offload_optimizer = self.cfg.offload_optimizer.enabled
        self.runtime = Zero3Runtime(self.z.plan.homes, world, ctx.rank % world, ctx.device,
                                    ctx.store, ctx.memory, group, hpz=hpz,
                                    hpz_group=hpz_group,
                                    host_shards=self.cfg.offload_param.enabled,
                                    host_update=offload_optimizer)
        self.context = ctx
        partitioned = [p for p in self.z.params if not self.z.home_of[p.suid].persistent]
        deepspeed = self.cfg.layout == StatesLayout.deepspeed
        phase = phases(ctx.trace)
        found = find_model_states(ctx.trace, ctx.liveness, partitioned, phase)
        self.states = plan_states(ctx.trace, found, self.cfg.reduce_bucket_size,
                                  contiguous=deepspeed)
        self.buffers = None
        if deepspeed and partitioned:
            accum = self.cfg.grad_accum_dtype
            self.buffers = deepspeed_buffers(partitioned, found, world,
                                             self.cfg.reduce_bucket_size,
                                             None if accum == GradAccumDtype.param else str(accum),
                                             offload_optimizer)
            # offloaded, the update steps the host's fp32 gradient partition: no flat copies
            for first, end in [] if offload_optimizer else update_windows(phase, UPDATE):
                self.states.late.setdefault(first, []).append(("update_begin", None))
                self.states.early.setdefault(end, []).insert(0, ("update_end", None))
        self.states_runtime = ModelStatesRuntime(
            self.states, world, ctx.rank % world, ctx.device, ctx.store, ctx.memory,
            self.runtime.metrics, views_of(ctx.trace, {m.suid for m in found}), group,
            self.buffers, host=offload_optimizer)

    def allocate(self) -> None:
        """Parameter shards (persistent parameters whole) and optimizer-state shards: held
        for the whole replay, allocated where the memory meter sees them (ReplayEngine._prepare)."""
        self.runtime.allocate()
        self.states_runtime.allocate()

    def resident_bytes(self) -> int:
        """Parameter shards, parameters kept whole and optimizer-state shards (the figures
        ``allocate`` charged; 0 before it ran)."""
        m, b = self.runtime.metrics, self.buffers
        ds = b.grad_partition_bytes + b.reduce_bucket_bytes if b is not None else 0
        return m.shard_bytes + m.persistent_bytes + m.optimizer_state_bytes + ds

    def owned_storages(self) -> set[int]:
        return {p.suid for p in self.z.params} | {m.suid for m in self.states.states}

    def hooks(self):
        """One hook per boundary: model-state frees and reduce-scatters, the parameter plan's
        events, then charges for what the next op makes. Under a policy that holds
        intermediates to the end of the iteration (pre_allocate), gradient shards and update
        temporaries are held too (dropped when the iteration ends)."""
        before, after = {}, {}
        n = self.z.plan.num_ops
        run, run_states = self.runtime.run, self.states_runtime.run
        frees = self.context.policy.frees_at_last_use
        early = {b: [e for e in ev if frees or e[0] != "release"]
                 for b, ev in self.states.early.items()}
        late, events = self.states.late, self.z.plan.events
        for b in sorted(set(events) | set(early) | set(late)):
            def hook(a=early.get(b, ()), ev=events.get(b), c=late.get(b, ())):
                run_states(a)
                if ev:
                    run(ev)
                run_states(c)
            if b < n:
                before[b] = [hook]
            else:
                after[n - 1] = [hook]
        return before, after

    def on_iteration_start(self) -> None:
        rt = self.runtime
        if rt.held.keys() - {h for h in rt.held if h.persistent} or rt.inflight:
            rt.drop_all()  # the previous iteration stopped half-way
        self.states_runtime.drop_all()
        rt.bind_persistent()
        self.states_runtime.bind_states()
        rt.metrics.start_iteration()

    def on_iteration_end(self, measured: bool) -> None:
        self.states_runtime.drop_all()  # what the policy holds to the end of the iteration
        self.runtime.metrics.end_iteration(measured)

    @classmethod
    def summarize_ranks(cls, parts: list[dict]) -> dict | None:
        return zero3_metrics.summarize_ranks(parts)

    def report(self) -> dict:
        z, cfg = self.z, self.cfg
        out = {"strategy": cfg.strategy.value, "world_size": z.world,
               "emulated": cfg.world_size is not None or self.runtime.group is None,
               "num_params": len(z.params),
               "num_partitioned": sum(1 for p in z.params if not z.home_of[p.suid].persistent),
               "param_bytes": sum(p.nbytes for p in z.params),
               "leaf_modules": [z.tree.modules[name].label for name in z.plan.leaves],
               "prefetch": cfg.prefetch, "hpz_partition_size": cfg.hpz_partition_size,
               "reduce_bucket_size": cfg.reduce_bucket_size,
               "num_grads": len(self.states.of_kind(GRAD)),
               "num_optimizer_states": len(self.states.of_kind(STATE)),
               "num_update_temporaries": len(self.states.of_kind(TEMP)),
               "layout": cfg.layout.value,
               "offload_optimizer": cfg.offload_optimizer.device.value,
               "offload_param": cfg.offload_param.device.value,
               "deepspeed_buffers": self.buffers.as_dict() if self.buffers else None}
        out.update(self.runtime.metrics.summary())
        if self.buffers is not None:  # the gradient shards live in DeepSpeed's partition buffer
            out["grad_shard_bytes"] = self.buffers.grad_partition_bytes
        out["modules"] = module_report(z, cfg.module_granularity_threshold)
        return out


def _node_group(rank: int, world: int, size: int, timeout_s: float):
    """This rank's hpZ group: ranks [k*size, (k+1)*size) (one node when ranks are ordered by
    node). Every rank creates every group, in the same order (a collective call)."""
    mine = None
    for k in range(world // size):
        pg = dist.new_group(list(range(k * size, (k + 1) * size)),
                            timeout=timedelta(seconds=timeout_s))
        if k == rank // size:
            mine = pg
    return mine


def trace_world_size(trace) -> int:
    """The world size the trace was recorded with: its default group's size."""
    sizes = [g.group_size or len(g.ranks) for g in trace.process_groups if g.name == "0"]
    if not sizes or sizes[0] < 1:
        raise ConfigError(f"{trace.path}: the trace does not record its world size (no default "
                          "process group); set zero3.world_size")
    return sizes[0]


def zero3_extensions(cfg: Zero3Config | None, trace) -> list:
    """The extensions a rank replays ``trace`` with under ``cfg`` (none for strategy none)."""
    if cfg is None or not cfg.enabled:
        return []
    return [Zero3Extension(cfg, read_backward_marks(trace))]
