"""What a prediction reads of a captured job's meta.json (the capture's, as it returned it or
as a cached folder holds it): the mesh (its degrees and the role of the worst rank:
actors/capture/workloads/mesh.py's roles; a fake mesh capture records one rank per role and
writes its ``mesh``), and the ops run as the target GPU's kernels."""
from __future__ import annotations


def mesh_facts(meta: dict, worst_rank: int) -> dict | None:
    """``{"description", "degrees", "ranks_per_role", "worst_rank_role"}`` of a capture whose
    meta.json names a mesh; None for a 1-D job."""
    mesh = meta.get("mesh")
    if not mesh:
        return None
    roles = mesh["roles"]
    role = next((name for name, ranks in roles.items() if worst_rank in ranks), None)
    return {"description": mesh["description"], "degrees": mesh["degrees"],
            "ranks_per_role": {name: len(ranks) for name, ranks in roles.items()},
            "worst_rank_role": role}


def ranks_per_trace(roles: dict[str, list[int]]) -> dict[str, int]:
    """``{recorded rank: ranks it stands for}`` of a mesh capture's ``{role: ranks}``."""
    return {str(ranks[0]): len(ranks) for ranks in roles.values()}


def kernel_dispatch(meta: dict) -> list[dict]:
    """The ops a capture's recording ran as a GPU's kernels (meta.json's ``kernel_dispatch``,
    actors/capture/fake/cuda_dispatch.py); [] when it ran the CPU's."""
    return meta.get("kernel_dispatch") or []
