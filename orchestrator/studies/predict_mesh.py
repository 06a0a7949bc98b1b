"""What a prediction reads of a captured job's meta.json: the mesh (its degrees and the role
of the worst rank: actors/capture/workloads/mesh.py's roles; a fake mesh capture records one rank
per role and writes its ``mesh``), and the ops run as the target GPU's kernels."""
from __future__ import annotations

from pathlib import Path

from actors.trace.meta_file import META_JSON, read_meta


def mesh_facts(folder: Path, worst_rank: int) -> dict | None:
    """``{"description", "degrees", "ranks_per_role", "worst_rank_role"}`` of a capture folder
    whose meta.json names a mesh; None for a 1-D job (or a folder without one)."""
    meta = read_meta(Path(folder) / META_JSON) or {}
    mesh = meta.get("mesh")
    if not mesh:
        return None
    roles = mesh["roles"]
    role = next((name for name, ranks in roles.items() if worst_rank in ranks), None)
    return {"description": mesh["description"], "degrees": mesh["degrees"],
            "ranks_per_role": {name: len(ranks) for name, ranks in roles.items()},
            "worst_rank_role": role}


def ranks_per_trace(folder) -> dict[str, int]:
    """``{recorded rank: ranks it stands for}`` of a mesh capture folder."""
    roles = read_meta(Path(folder) / META_JSON)["mesh"]["roles"]
    return {str(ranks[0]): len(ranks) for ranks in roles.values()}


def roles_of(folder) -> dict[str, list[int]] | None:
    """``{role: ranks}`` of a mesh capture folder (None for a 1-D one)."""
    mesh = (read_meta(Path(folder) / META_JSON) or {}).get("mesh")
    return mesh["roles"] if mesh else None


def kernel_dispatch(folder) -> list[dict]:
    """The ops a capture folder's recording ran as a GPU's kernels (meta.json's
    ``kernel_dispatch``, actors/capture/fake/cuda_dispatch.py); [] when it ran the CPU's."""
    return (read_meta(Path(folder) / META_JSON) or {}).get("kernel_dispatch") or []
