"""Base class of every rank actor: placement introspection, rendezvous env, health, teardown.

A plain class on purpose: the driver wraps the concrete subclasses (actors/rank_actor.py,
actors/capture/actor.py) with ``ray.remote`` and chooses their resources and placement.
"""
from __future__ import annotations

import os
import random
import socket

import ray
import torch.distributed as dist

from actors.launcher_env import launcher_environment


_EPHEMERAL = "/proc/sys/net/ipv4/ip_local_port_range"
_LOWEST_PORT = 20_000  # above Ray's default worker ports (10002-19999)
_NUM_TRIES = 64
_PICK = random.SystemRandom()  # not the seeded global: two test workers seeded alike collide


def _ephemeral_start() -> int:
    """The first port of the kernel's ephemeral range (Linux's default 32768 where unknown)."""
    try:
        with open(_EPHEMERAL) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now ("" = every interface of this machine).

    Taken below the kernel's ephemeral range: a port the kernel handed out (bind to port 0)
    is freed again before the rendezvous binds it, and meanwhile any outgoing connection of
    the machine (Ray's, another rank's) may be given it (EADDRINUSE under load). Below that
    range (and above Ray's worker ports) only another explicit bind can take it. Falls back
    to a kernel-chosen port."""
    top = _ephemeral_start()
    if top > _LOWEST_PORT:
        for _ in range(_NUM_TRIES):
            port = _PICK.randrange(_LOWEST_PORT, top)
            if _bindable(host, port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class RankWorkerBase:
    """One rank of a worker group. ``setup()`` is called once by the driver before any work."""

    rank: int | None = None
    local_rank: int | None = None
    world_size: int | None = None
    local_world_size: int | None = None
    node_rank: int | None = None
    node_ip: str | None = None
    device_index: int | None = None  # the rank's GPU among the node's visible ones

    def node_info(self) -> dict:
        """Where this actor runs: node_ip, node_id, gpu_ids (Ray-assigned), pid, hostname."""
        ctx = ray.get_runtime_context()
        self.node_ip = ray.util.get_node_ip_address()
        return {
            "node_ip": self.node_ip,
            "node_id": ctx.get_node_id(),
            "gpu_ids": [str(g) for g in ctx.get_accelerator_ids().get("GPU", [])],
            "pid": os.getpid(),
            "hostname": socket.gethostname(),
        }

    def find_free_port(self) -> int:
        """A TCP port free on this node right now (for MASTER_PORT when this is rank 0)."""
        return free_port("")

    def setup(self, rank: int, local_rank: int, world_size: int, local_world_size: int,
              node_rank: int, master_addr: str, master_port: int,
              cuda_visible_devices: str | None = None, device_index: int | None = None) -> None:
        """Record this actor's place in the group and export the torch.distributed env vars.

        On GPU nodes the driver passes every GPU of the node (``cuda_visible_devices``) and
        this rank's index among them; this must run before CUDA is initialized here.
        """
        self.rank, self.local_rank, self.world_size = rank, local_rank, world_size
        self.local_world_size, self.node_rank = local_world_size, node_rank
        if cuda_visible_devices is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = cuda_visible_devices
            self.device_index = device_index
        os.environ.update(launcher_environment(rank, local_rank, world_size, local_world_size,
                                               node_rank, master_addr, master_port))

    def ping(self) -> bool:
        """Health check: True as soon as the actor can run a method."""
        return True

    def shutdown(self) -> None:
        """Release distributed state before the driver kills the actor; subclasses extend."""
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()

    def __repr__(self) -> str:
        # Ray prefixes the actor's log lines with this.
        return (f"{type(self).__name__}(rank={self.rank}, world={self.world_size}, "
                f"node={self.node_ip})")
