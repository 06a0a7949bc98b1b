"""Test helpers for Ray-backed tests: a two-node local Ray cluster and a gloo probe actor.

``ray_two_node_cluster()`` starts a head node and a worker node on 127.0.0.2 with
``ray start --block`` (each in its own process group, own temp dir, explicit ports, and
token auth), points this process's Ray auth at the cluster's token, and stops exactly
those processes by PID afterwards. It never runs ``ray stop``.
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import psutil
import pytest
import ray
import ray.cloudpickle
import torch
import torch.distributed as dist

from actors.rank_base import RankWorkerBase
from tests.support.bounds import CLUSTER_START_S

WORKER_IP = "127.0.0.2"
_STARTED = "Ray runtime started"
_AUTH_VARS = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")
_RAY = str(Path(sys.executable).with_name("ray"))


class GlooProbe(RankWorkerBase):
    """A minimal rank actor: reports its env, runs a gloo all_reduce, fails on request."""

    ENV_KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK",
                "MASTER_ADDR", "MASTER_PORT")

    def env(self) -> dict:
        return {key: os.environ.get(key) for key in self.ENV_KEYS}

    def all_reduce(self, timeout_s: float = 30.0) -> float:
        """Sum of (rank + 1) over the group, computed by gloo."""
        if not dist.is_initialized():
            dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
        value = torch.tensor([float(self.rank + 1)])
        dist.all_reduce(value)
        return value.item()

    def misbehave(self, bad_rank: int, how: str, then_all_reduce: bool = False):
        """On ``bad_rank``: 'raise', 'exit' (kill the process) or 'hang'. Others return
        their rank, after an all_reduce that the bad rank never joins if asked."""
        if self.rank == bad_rank:
            if how == "raise":
                raise ValueError(f"rank {self.rank} fails on purpose")
            if how == "exit":
                time.sleep(0.5)
                os._exit(3)
            time.sleep(600)
        if then_all_reduce:
            self.all_reduce()
        return self.rank


# Classes defined under tests/ cannot be imported by Ray workers (tests/ is not on their
# sys.path): ship this module's code by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


@dataclass
class TwoNodeCluster:
    """A running two-node cluster; ``env`` holds the auth vars a driver subprocess needs."""

    address: str  # "127.0.0.1:<gcs port>", for cluster.address
    head_ip: str | None  # Ray resolves 127.0.0.1 to the machine's IP for the head
    worker_ip: str
    temp_dir: str
    env: dict = field(default_factory=dict)
    pids: list[int] = field(default_factory=list)  # the `ray start --block` processes


# Ray's own bound on a node's start (30 s, not configurable): a loaded CI machine can miss it.
_RAY_START_TIMED_OUT = "timed out during startup"


@contextlib.contextmanager
def ray_two_node_cluster(num_cpus_per_node: int = 2, timeout_s: float = CLUSTER_START_S,
                         object_store_bytes: int = 256 * 1024**2):
    """``_two_node_cluster``, started once more (fresh ports and folders) when a node missed
    Ray's own start bound; any other failure, or a second miss, raises. ``timeout_s`` bounds
    each node's start: the suite's cluster bound, since beside busy processes a head node took
    over 60 s to start (the two-hog run of 2026-12-06)."""
    for attempt in (1, 2):
        cm = _two_node_cluster(num_cpus_per_node, timeout_s, object_store_bytes)
        try:
            cluster = cm.__enter__()  # on failure its own cleanup has already run
            break
        except RuntimeError as e:
            if attempt == 2 or _RAY_START_TIMED_OUT not in str(e):
                raise
    try:
        yield cluster
    except BaseException:
        if not cm.__exit__(*sys.exc_info()):
            raise
    else:
        cm.__exit__(None, None, None)


@contextlib.contextmanager
def _two_node_cluster(num_cpus_per_node: int, timeout_s: float, object_store_bytes: int):
    """Start head + worker node, yield a TwoNodeCluster, always stop both.

    This process must not be connected to Ray on entry. While the cluster runs,
    os.environ carries RAY_AUTH_MODE=token and the cluster's RAY_AUTH_TOKEN (restored on
    exit), so ``ray.init(address=cluster.address)`` works here and in subprocesses.
    """
    if ray.is_initialized():
        raise RuntimeError("ray_two_node_cluster() needs a process not connected to Ray")
    temp_dir = tempfile.mkdtemp(prefix="tf-rn-", dir="/tmp")
    auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": uuid.uuid4().hex}
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", *_AUTH_VARS)}
    # Without this a SIGTERMed node drains for 30 s before it stops.
    env.update(auth, RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0", RAY_USAGE_STATS_ENABLED="0")
    port, client_port, dash_port, head_agent, worker_agent = _free_ports(5)
    common = ["--block", f"--num-cpus={num_cpus_per_node}", "--disable-usage-stats",
              f"--object-store-memory={object_store_bytes}", "--log-style=record",
              "--log-color=false"]
    procs: list[subprocess.Popen] = []
    saved_auth = {k: os.environ.get(k) for k in _AUTH_VARS}
    try:
        head_log = Path(temp_dir, "head.log")
        procs.append(_launch([
            _RAY, "start", "--head", "--node-ip-address=127.0.0.1", f"--port={port}",
            f"--temp-dir={temp_dir}/h", "--include-dashboard=false",
            f"--dashboard-port={dash_port}", f"--ray-client-server-port={client_port}",
            f"--dashboard-agent-listen-port={head_agent}", *common], env, head_log))
        # The worker node only needs the GCS: overlap its start with the head's.
        _wait_listening(procs[-1], port, head_log, timeout_s)
        worker_log = Path(temp_dir, "worker.log")
        procs.append(_launch([
            _RAY, "start", f"--address=127.0.0.1:{port}", f"--node-ip-address={WORKER_IP}",
            f"--temp-dir={temp_dir}/w", f"--dashboard-agent-listen-port={worker_agent}",
            *common], env, worker_log))
        _wait_started(procs[0], head_log, timeout_s)
        _wait_started(procs[1], worker_log, timeout_s)
        match = re.search(r"Local node IP: (\S+)", head_log.read_text())
        os.environ.update(auth)
        os.environ.pop("RAY_AUTH_TOKEN_PATH", None)
        _reload_ray_auth()
        yield TwoNodeCluster(f"127.0.0.1:{port}", match.group(1) if match else None,
                             WORKER_IP, temp_dir, dict(auth), [p.pid for p in procs])
    finally:
        if ray.is_initialized() and ray.get_runtime_context().gcs_address.endswith(f":{port}"):
            ray.shutdown()  # the driver must leave before its cluster disappears
        for proc in reversed(procs):
            _stop(proc)
        for key, value in saved_auth.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        _reload_ray_auth()
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def two_node_cluster():
    """Module-scoped ray_two_node_cluster(); import it into a test module to use it."""
    with ray_two_node_cluster() as cluster:
        yield cluster


def _free_ports(count: int) -> list[int]:
    socks = [socket.socket() for _ in range(count)]
    try:
        for sock in socks:  # hold all open at once so the ports differ
            sock.bind(("", 0))
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def _launch(cmd: list[str], env: dict, log_path: Path) -> subprocess.Popen:
    launched_at = time.time()
    with open(log_path, "wb") as out:
        # Own session: the processes the node starts share this process group id.
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    proc.launched_at = launched_at
    return proc


def _wait_listening(proc: subprocess.Popen, port: int, log_path: Path,
                    timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
            return
        _check_alive(proc, log_path)
        time.sleep(0.2)
    raise RuntimeError(f"{' '.join(proc.args[:3])}: nothing listens on port {port} after "
                       f"{timeout_s} s:\n{log_path.read_text(errors='replace')[-3000:]}")


def _check_alive(proc: subprocess.Popen, log_path: Path) -> None:
    if proc.poll() is not None:
        raise RuntimeError(f"{' '.join(proc.args[:3])} exited with {proc.returncode}:\n"
                           f"{log_path.read_text(errors='replace')[-3000:]}")


def _wait_started(proc: subprocess.Popen, log_path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = log_path.read_text(errors="replace")
        if _STARTED in text:
            return
        _check_alive(proc, log_path)
        time.sleep(0.2)
    raise RuntimeError(f"{' '.join(proc.args[:3])} not started within {timeout_s} s:\n"
                       f"{log_path.read_text(errors='replace')[-3000:]}")


def _stop(proc: subprocess.Popen, graceful_s: float = 10.0) -> None:
    """SIGTERM the `ray start --block` process (it stops its node), then SIGKILL what is
    left of its process tree and of the process group it leads."""
    try:
        family = [psutil.Process(proc.pid)]
        family += family[0].children(recursive=True)
    except psutil.NoSuchProcess:
        family = []
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=graceful_s)
    for member in psutil.process_iter():
        # create_time guards against a recycled group id.
        with contextlib.suppress(psutil.Error, OSError):
            if (os.getpgid(member.pid) == proc.pid
                    and member.create_time() >= proc.launched_at - 1):
                family.append(member)
    for member in family:
        with contextlib.suppress(psutil.Error):
            member.kill()  # psutil refuses if the pid now belongs to another process
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)


def _reload_ray_auth() -> None:
    """Make this process's Ray re-read RAY_AUTH_* (it caches the token on first use)."""
    from ray._private.authentication_test_utils import reset_auth_token_state
    reset_auth_token_state()


def kill_node(cluster: TwoNodeCluster, index: int) -> list[int]:
    """SIGKILL node ``index`` of ``cluster`` (0 head, 1 worker) as a machine loss would: its
    `ray start` process group (raylet, agents) and every process it started (the actor
    workers run in process groups of their own). Returns the pids killed."""
    root = cluster.pids[index]
    try:
        family = [psutil.Process(root), *psutil.Process(root).children(recursive=True)]
    except psutil.NoSuchProcess:
        family = []
    with contextlib.suppress(ProcessLookupError):
        os.killpg(root, signal.SIGKILL)
    for member in family:
        with contextlib.suppress(psutil.Error):
            member.kill()
    return [p.pid for p in family]


def wait_for_title(root_pid: int, title: str, timeout_s: float, alive=None) -> psutil.Process:
    """The first descendant of ``root_pid`` whose process title contains ``title`` (Ray sets
    ``ray::<Actor>.<method>`` while an actor runs a method), polled until ``timeout_s``.
    ``alive()`` returning False (e.g. the driver exited) ends the wait early."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(psutil.Error):
            for proc in psutil.Process(root_pid).children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    if title in proc.name() or title in " ".join(proc.cmdline()):
                        return proc
        if alive is not None and not alive():
            raise RuntimeError(f"gave up waiting for a {title!r} process: the watched run ended")
        time.sleep(0.2)
    raise RuntimeError(f"no {title!r} process under pid {root_pid} within {timeout_s} s")
