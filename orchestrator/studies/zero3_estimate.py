"""What the field's estimator says a model needs under ZeRO-3: DeepSpeed's
``estimate_zero3_model_states_mem_needs_all_live`` figures, for the OOM study's table.

DeepSpeed's estimate counts model states only (parameters, gradients, optimizer state, at 18
bytes a parameter for mixed-precision Adam, plus 4 bytes per parameter of the largest layer),
never activations, temporaries or when things are freed: that difference is what a replay
shows. ``estimate_zero3_model_states_mem_needs_all_live(model)`` prints its table from
``model_to_params(model)``, which tells parameters apart by ``data_ptr()``; on the meta
device (where a 70B model can exist here) every ``data_ptr()`` is 0, so it would count one
parameter. ``param_counts`` applies the same rule with tensor identity instead, and the rows
come from ``estimate_zero3_model_states_mem_needs``, the function ``_all_live`` prints from.
"""
from __future__ import annotations

from actors.errors import ConfigError

# (offload_optimizer, offload_param) as DeepSpeed's table lists them; zero_init=1 (ZeRO-3's
# usual deepspeed.zero.Init), which changes the CPU figure only.
_OPTIONS = ((True, True), (True, False), (False, False))


def param_counts(model) -> tuple[int, int]:
    """``(total parameters, largest layer's own parameters)`` by DeepSpeed's
    ``model_to_params`` rule (a shared parameter counted once), on any device."""
    total = sum({id(p): p.numel() for p in model.parameters()}.values())
    largest = max((sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()),
                  default=0)
    return total, largest


def nodes_of(world_size: int, gpus_per_node: int) -> tuple[int, int]:
    """``(gpus per node, nodes)`` of a ``world_size``-GPU job; ConfigError when nodes would
    not be full."""
    if world_size < 1 or gpus_per_node < 1:
        raise ConfigError(f"world size {world_size}, experiment.oom_study.gpus_per_node="
                          f"{gpus_per_node}; expected both >= 1")
    per_node = min(gpus_per_node, world_size)
    if world_size % per_node:
        raise ConfigError(f"world size {world_size} is not a whole number of nodes of "
                          f"experiment.oom_study.gpus_per_node={gpus_per_node}")
    return per_node, world_size // per_node


def zero3_estimates(model, world_size: int, gpus_per_node: int) -> list[dict]:
    """One dict per offload option: ``options`` (as DeepSpeed prints them),
    ``estimated_gpu_bytes`` and ``estimated_cpu_bytes`` (per GPU, per node's CPU), with the
    counts and the layout they were computed for."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

    total, largest = param_counts(model)
    per_node, nodes = nodes_of(world_size, gpus_per_node)
    rows = []
    for offload_optimizer, offload_param in _OPTIONS:
        cpu, gpu, _ = estimate_zero3_model_states_mem_needs(
            total_params=total, largest_layer_params=largest, num_gpus_per_node=per_node,
            num_nodes=nodes, cpu_offload=offload_optimizer, cpu_offload_params=offload_param,
            zero_init=True)
        rows.append({
            "options": f"offload_param={'cpu' if offload_param else 'none'}, offload_optimizer="
                       f"{'cpu' if offload_optimizer else 'none'}, zero_init=1",
            "estimated_gpu_bytes": int(gpu), "estimated_cpu_bytes": int(cpu),
            "num_params": total, "largest_layer_params": largest,
            "gpus_per_node": per_node, "num_nodes": nodes})
    return rows
