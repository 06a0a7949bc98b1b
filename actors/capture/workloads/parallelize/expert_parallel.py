"""Expert parallel on the Llama's MoE blocks (actors/capture/workloads/moe.py), as torchtitan
applies it.

``ep`` ranks of ``dp_shard x cp`` share one set of experts: each holds ``num_experts / ep`` of
them (torchtitan's ``ExpertParallel`` places the stacked expert weights ``Shard(0)`` over
``ep``; here the rank's slice is held as plain parameters, the same bytes) and the MoE block
exchanges tokens with its ``ep`` peers by all-to-all. The other parameters stay FSDP's over
``dp_shard x cp``. The experts get an FSDP unit of their own over the ranks that hold the
same experts, ``efsdp = dp_shard x cp / ep`` (with HSDP's replicas beside it), kept even at
size 1 for the mixed-precision casts, as torchtitan keeps it.

The expert mesh is ``(pp, dp_replicate, efsdp, ep)`` over the same ranks as the job's mesh
(actors/capture/workloads/mesh.py's ``build_mesh`` builds it beside the job's and hangs it on it as
``expert_mesh``): ``ep`` neighbours are the innermost ranks of ``dp_shard x cp``.
"""
from __future__ import annotations

import torch.nn as nn

from actors.capture.workloads.moe import MoE


def moe_blocks(model: nn.Module) -> list[MoE]:
    """The MoE feed-forwards of ``model``'s blocks (none for a dense model)."""
    from actors.capture.workloads.parallelize.tensor_parallel import blocks

    return [b.feed_forward for b in blocks(model) if isinstance(b.feed_forward, MoE)]


def apply_expert_parallel(model: nn.Module, ep_mesh) -> None:
    """Keep this rank's share of every MoE block's experts and give the blocks the 1-D
    ``ep_mesh``'s group (in place)."""
    ep, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    for moe in moe_blocks(model):
        experts = moe.experts
        local = moe.spec.num_experts // ep
        for name in ("w1", "w2", "w3"):
            whole = getattr(experts, name)
            setattr(experts, name, nn.Parameter(whole.detach()[rank * local:(rank + 1) * local]
                                                .clone()))
        moe.ep_group, moe.ep_rank, moe.ep_size = ep_mesh.get_group(), rank, ep


def expert_fsdp_mesh(expert_mesh):
    """The experts' FSDP mesh: ``(dp_replicate, efsdp)`` (HSDP) or ``efsdp``."""
    names = expert_mesh.mesh_dim_names
    return expert_mesh["dp_replicate", "efsdp"] if "dp_replicate" in names \
        else expert_mesh["efsdp"]
