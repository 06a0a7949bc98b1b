"""One capture job: train a workload on a Ray worker group and record one ET per rank.

Writes ``rank-<r>.et.json.gz`` and the profiler trace of the same iteration,
``rank-<r>.kineto.json.gz``, for every rank, and ``meta.json`` (world size, workload knobs,
versions, eager iteration times measured without the observer, the original's measured
memory) into ``out_dir``. ``workload.device=meta`` or ``fake`` captures in this process over a
fake process group instead (no Ray, any world size, no timings or memory). The command line
is orchestrator/cli/capture.py (``tracefleet-capture``); studies capture through
``run_capture_job`` too (orchestrator/studies/study_traces.py).
"""
from __future__ import annotations

import copy
import dataclasses
import glob
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from actors.config_fields import check_finite, setting
from actors.trace.conventions import kineto_file_name, trace_file_name
from actors.capture.workloads.mesh import validate_parallelism
from actors.trace.meta_file import META_JSON, build_meta
from actors.trace.model import MAX_WORLD_SIZE
from actors.capture.workloads.config import WorkloadConfig, validate as validate_workload
from actors.errors import ConfigError, TracefleetError
from actors.capture.bound import RecordingBound
from actors.capture.request import CaptureRequest
from orchestrator.config import ClusterConfig, Transfer
from orchestrator.run.fake_check import check_fake
from orchestrator.run.roles_config import RolesConfig
from actors.atomic_file import atomic_write
from actors.capture.workloads.custom import load_build, resolve_entrypoint


@dataclass
class CaptureConfig:
    """The root config of ``tracefleet-capture``: record one ET per rank of a workload."""

    workload: WorkloadConfig = setting(factory=WorkloadConfig, help=(
        "The model and how it is trained (actors/capture/workloads/build.py)."))
    cluster: ClusterConfig = setting(factory=ClusterConfig, help=(
        "Where the rank actors run (shared with tracefleet)."))
    world_size: int = setting(4, help=(
        "Number of ranks: one Ray actor each; on workload.device=meta or fake captured in this "
        "process over a fake process group, so any number (the machine's size does not "
        "matter)."))
    warmup_iters: int = setting(3, help=(
        "Iterations run before timing (not recorded): allocator, DeepSpeed and gloo warm-up. "
        "The last one is the memory-measured iteration (cpu: under the profiler's allocator "
        "events, so none of them is timed). meta and fake run exactly one (the optimizer "
        "state)."))
    timing_iters: int = setting(5, help=(
        "Iterations timed without the observer; each rank reports their median."))
    num_threads: int = setting(0, help=(
        "torch intra-op threads per rank; 0 keeps the default (Ray sets OMP_NUM_THREADS from "
        "cluster.cpus_per_rank)."))
    module_backward_ranges: bool = setting(True, help=(
        "Also mark each module's backward with begin/end marker nodes (adds autograd hook "
        "ops)."))
    record_kineto: bool = setting(True, help=(
        "Also write rank-<r>.kineto.json.gz: the host time between ops (replay.host_gaps), "
        "from the fastest of 3 bare iterations under torch.profiler after the ET's. Not on "
        "meta/fake."))
    dist_timeout_s: float = setting(300.0, help="Timeout of one gloo collective on the ranks, "
                                                "seconds.")
    capture_timeout_s: float = setting(900.0, help=(
        "Bound on the whole capture on every rank, seconds (a cold DeepSpeed op build takes "
        "~90 s); on meta and fake on each rank recorded in this process (a mesh job records "
        "one per role; a step that never returns is stopped)."))
    capture_stall_s: float = setting(120.0, help=(
        "On meta and fake: stop a capture whose step stays at the very same place (every "
        "frame's line) this long, seconds, with an error naming the place, well before "
        "capture_timeout_s (a wait or a loop that never ends); 0: only the whole bound."))
    out_dir: str = setting("${hydra:runtime.output_dir}/traces", help=(
        "Folder for the rank traces and meta.json (relative paths are taken from the cwd)."))
    overwrite: bool = setting(False, help=(
        "Replace rank traces already in out_dir (otherwise refuse, so no stale rank is mixed "
        "in)."))
    roles: RolesConfig = setting(factory=RolesConfig, help=(
        "On fake, a mesh job's roles (one recorded rank each): how many are recorded at once "
        "and where (orchestrator/run/roles.py)."))
    transfer: Transfer = setting(Transfer.path, help=(
        "path: ranks write into out_dir (shared filesystem); object_store: ranks send the "
        "bytes back through Ray and the driver writes them."))

    def validate(self) -> None:
        """Raise ConfigError on inconsistent values (before any cluster work); a custom
        entrypoint is resolved (a file made absolute) and its function looked up here."""
        check_finite(self)
        check_world_size(self.world_size)
        validate_workload(self.workload)
        validate_parallelism(self.workload, self.world_size)
        if self.workload.model == "custom":
            self.workload.entrypoint = resolve_entrypoint(self.workload.entrypoint)
            load_build(self.workload.entrypoint)
        if self.capture_stall_s < 0:
            raise ConfigError(f"capture_stall_s={self.capture_stall_s:g}; expected seconds >= 0 "
                              "(0: no stall bound)")
        if self.warmup_iters < 1 or self.timing_iters < 1:
            raise ConfigError(f"warmup_iters={self.warmup_iters} and timing_iters="
                              f"{self.timing_iters} must be >= 1 (the last warm-up iteration "
                              "is the memory-measured one)")
        self.cluster.validate()
        self.roles.validate()

    def request(self) -> CaptureRequest:
        """What each rank runs. Its workload is a copy: a rank recorded in this process
        shares no object with the config meta.json is written from."""
        return CaptureRequest(
            workload=copy.deepcopy(self.workload), warmup_iters=self.warmup_iters,
            timing_iters=self.timing_iters, num_threads=self.num_threads,
            dist_timeout_s=self.dist_timeout_s,
            module_backward_ranges=self.module_backward_ranges, record_kineto=self.record_kineto)


@dataclass(frozen=True)
class CaptureResult:
    """A finished capture: its folder and the meta.json written there, for the caller to use
    instead of reading back the file it just wrote (a folder given by the user is still read
    from its meta.json: actors/trace/meta_file.py)."""

    folder: Path
    meta: dict

    @property
    def roles(self) -> dict[str, list[int]] | None:
        """``{role: ranks}`` of a mesh job (one recorded rank per role); None for a 1-D job."""
        mesh = self.meta.get("mesh")
        return mesh["roles"] if mesh else None


def check_world_size(world_size: int, key: str = "world_size") -> None:
    """ConfigError unless 1 <= world_size <= MAX_WORLD_SIZE: a capture's fake process group
    and device mesh hold a table of every rank (torch's rank map and the mesh's rank tensor,
    ~140 MiB at the bound), and a larger world would grow them past any machine's memory
    (10^9 ranks: ~140 GB) before anything could be said; checked before any capture."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"{key}={world_size!r}: expected an integer >= 1")
    if world_size > MAX_WORLD_SIZE:
        raise ConfigError(f"{key}={world_size:,} exceeds {MAX_WORLD_SIZE:,} ranks, the most a "
                          "capture serves: its fake process group and device mesh (and "
                          "pre-flight's checks) keep a table of every rank, ~140 MiB at that "
                          "bound, growing with every rank")


def _rank_files(out_dir: str) -> list[str]:
    """The rank traces and profiles in out_dir (their ``.partial`` files too)."""
    return sorted(glob.glob(os.path.join(out_dir, "rank-*.et.json*"))
                  + glob.glob(os.path.join(out_dir, "rank-*.kineto.json*")))


def prepare_out_dir(out_dir: str, overwrite: bool) -> None:
    """Create out_dir; refuse (or with overwrite, delete) rank traces already there."""
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"out_dir={out_dir}: cannot create it ({e.strerror or e}); choose a "
                          "writable folder") from None
    stale = _rank_files(out_dir)
    if stale and not overwrite:
        raise ConfigError(f"out_dir={out_dir} already holds {len(stale)} rank trace(s) "
                          f"({os.path.basename(stale[0])}, ...); pass overwrite=true or "
                          "choose another out_dir")
    for path in stale:
        os.remove(path)


def run_capture_job(cfg: CaptureConfig, rank0_only: bool = False,
                    timeout_key: str = "capture_timeout_s", stall_key: str = "capture_stall_s",
                    roles_key: str = "roles") -> CaptureResult:
    """Capture ``cfg.world_size`` rank traces into cfg.out_dir, with its meta.json.
    ``rank0_only`` (meta and fake: every rank's trace is rank 0's) writes rank 0's alone.
    ``timeout_key``, ``stall_key``, ``roles_key``: the settings a stopped capture names (the
    caller's own for the bounds)."""
    cfg.validate()
    out_dir = os.path.abspath(cfg.out_dir)
    prepare_out_dir(out_dir, cfg.overwrite)
    start = time.perf_counter()
    try:
        if cfg.workload.device in ("meta", "fake"):
            # the fake device's machinery (FakeTensorMode, Dynamo, inductor's scheduler) costs
            # ~2 s to import: only a capture on meta or fake pays it
            from actors.capture.meta_world import run_meta_capture
            from orchestrator.run.roles import role_runner  # the fake device's imports too

            # each recording is bounded where it runs: here, or in its role's worker
            bound = RecordingBound(cfg.workload.device, cfg.capture_timeout_s, timeout_key,
                                   cfg.capture_stall_s, stall_key,
                                   int(cfg.roles.memory_limit_gib * 2**30),
                                   f"{roles_key}.memory_limit_gib")
            ranks = run_meta_capture(cfg.request(), out_dir, cfg.world_size,
                                     num_files=1 if rank0_only else None, bound=bound,
                                     run_roles=role_runner(cfg.roles, roles_key))
        else:
            ranks = _capture_on_ray(cfg, out_dir)
        meta = build_meta(ranks, out_dir, time.perf_counter() - start,
                          world_size=cfg.world_size, workload=dataclasses.asdict(cfg.workload),
                          warmup_iters=cfg.warmup_iters, timing_iters=cfg.timing_iters,
                          module_backward_ranges=cfg.module_backward_ranges)
        if cfg.workload.check_fake:  # the same step for real at world 2 (fake_check.py)
            meta["check_fake"] = check_fake(cfg, out_dir, run_capture_job).to_dict()
        text = json.dumps(meta, indent=2)
        # replaced, never written through: a symlink planted as meta.json stays pointing at
        # a file tracefleet does not touch
        atomic_write(Path(out_dir) / META_JSON, text.encode())
    except BaseException:  # a failed or stopped capture leaves no rank file a rerun refuses
        for path in _rank_files(out_dir) + [os.path.join(out_dir, META_JSON)]:
            if os.path.exists(path):
                os.remove(path)
        raise
    # the meta as the file holds it (JSON's lists and string keys): what a later reader of the
    # folder, or of a cached capture, gets too
    return CaptureResult(Path(out_dir), json.loads(text))


def _capture_on_ray(cfg: CaptureConfig, out_dir: str) -> list[dict]:
    """One CaptureActor per rank; their facts in rank order, files in out_dir."""
    # Ray and the actor classes (which import ray) only for a capture on Ray: keeps `--help`
    # and a meta or fake capture fast
    import ray

    from actors.capture.actor import CaptureActor
    from orchestrator.cluster.connect import connect
    from orchestrator.cluster.worker_group import WorkerGroup

    handle = connect(cfg.cluster, cfg.world_size)
    try:
        group = WorkerGroup(ray.remote(CaptureActor), cfg.world_size, cfg.cluster,
                            use_gpu=cfg.workload.device == "cuda")
        try:
            group.start()
            results = group.run("capture", cfg.request(), out_dir,
                                cfg.transfer == "object_store", timeout_s=cfg.capture_timeout_s)
        finally:
            group.shutdown()
    finally:
        handle.shutdown()
    failed = [r for r in results if not r.ok]
    if failed:
        details = "; ".join(f"rank {r.rank} {r.kind}: {r.error}" for r in failed)
        raise TracefleetError(f"capture failed on {len(failed)} of {cfg.world_size} rank(s): "
                              f"{details}")
    ranks = [r.value for r in results]
    for info in ranks:
        for key, bytes_key, name in (("path", "trace_bytes", trace_file_name),
                                     ("kineto_path", "kineto_bytes", kineto_file_name)):
            data = info.pop(bytes_key, None)
            if data is not None:
                info[key] = os.path.join(out_dir, name(info["rank"]))
                with open(info[key], "wb") as f:
                    f.write(data)
            elif info.get(key) and not os.path.exists(info[key]):
                raise TracefleetError(
                    f"rank {info['rank']} wrote {info[key]} on {info['hostname']}, but the "
                    "driver cannot see it: use a shared out_dir or transfer=object_store")
    return ranks
