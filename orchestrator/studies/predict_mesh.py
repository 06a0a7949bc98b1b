"""What a prediction says about the mesh of a captured job: its degrees and the role of the
worst rank (actors/capture/mesh.py's roles; a fake mesh capture records one rank per role
and writes its meta.json ``mesh``)."""
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
