"""The environment variables torch's launcher (torchrun) gives each rank: set on every replay
actor (actors/rank_base.py) and around every rank a meta or fake capture records in one
process (actors/capture/meta_world.py), since a user's step or its library reads them
(DeepSpeed's engine asserts LOCAL_RANK)."""
from __future__ import annotations


def launcher_environment(rank: int, local_rank: int, world_size: int, local_world_size: int,
                         node_rank: int, master_addr: str | None = None,
                         master_port: int | None = None) -> dict[str, str]:
    """``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``NODE_RANK`` and, when
    given, ``MASTER_ADDR`` / ``MASTER_PORT``, as strings."""
    env = {"RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(world_size),
           "LOCAL_WORLD_SIZE": str(local_world_size), "NODE_RANK": str(node_rank)}
    if master_addr is not None:
        env |= {"MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port)}
    return env
