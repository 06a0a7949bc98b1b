"""workload.device=fake: FSDP2 steps captured under FakeTensorMode over a fake process group, at
any world size, in one process: mixed-precision dtypes, shard sizes, storage ids, the built-in
workloads, and what cannot run there (DeepSpeed) said clearly."""
from __future__ import annotations

import gzip
import math
import resource
from collections import Counter
from pathlib import Path

import orjson
import pytest
import torch

from actors.trace.conventions import FREED_OP, WRAPPER_STORAGE_OP, trace_file_name
from actors.capture.workloads.custom import load_build
from actors.capture.fake.fake_mode import (DISPATCH_MODE_NODE, SUBCLASS_NODE, CaptureFakeMode,
                                           _devices)
from actors.capture.fake.meta_storage import unique_meta_storages
from actors.capture.workloads.build import WorkloadConfig
from actors.errors import ConfigError
from actors.trace import load_trace
from orchestrator.config import REPO_ROOT
from orchestrator.run.capture import CaptureConfig, run_capture_job
from tests.capture.test_capture_meta import SMALL_LLAMA, meta_capture

REPO = REPO_ROOT
FSDP2_EXAMPLE = str(REPO / "examples" / "fsdp2_llama_step.py") + ":build"
DDP_EXAMPLE = str(REPO / "examples" / "ddp_step.py") + ":build"
# Ops that allocate a new storage: on fake (as on meta) no address is ever reused.
ALLOCATING = {"aten::empty", "aten::empty_like", "aten::empty_strided", "aten::zeros",
              "aten::zeros_like", "aten::new_empty", "aten::new_zeros", "aten::randint"}


def fake_capture(out_dir: Path, world_size: int, entrypoint: str = FSDP2_EXAMPLE) -> dict:
    cfg = CaptureConfig(workload=WorkloadConfig(model="custom", entrypoint=entrypoint,
                                                device="fake"),
                        world_size=world_size, out_dir=str(out_dir))
    return run_capture_job(cfg).meta


def example_shapes(env: dict) -> list[tuple[int, ...]]:
    """Parameter shapes of the FSDP2 example at the sizes ``env`` gives (built on meta)."""
    module = load_build(FSDP2_EXAMPLE).__globals__
    size = lambda name, default: int(env.get(f"EXAMPLE_{name}", default))  # noqa: E731
    with torch.device("meta"):
        model = module["Transformer"](size("VOCAB", 512), size("DIM", 64), size("LAYERS", 2),
                                      size("HEADS", 4))
    return [tuple(p.shape) for p in model.parameters()]


def rank0_shard_numel(shape: tuple[int, ...], world_size: int) -> int:
    """FSDP2 shards dim 0 as torch.chunk does: rank 0 holds ceil(dim0 / world) rows."""
    return math.ceil(shape[0] / world_size) * math.prod(shape[1:])


def param_shards(trace) -> dict:
    """``{storage id: (numel, dtype)}`` of the rank's parameter shards: what FSDP2 copies into
    its all-gather input before each gather (the optimizer's ops are recorded on the DTensors,
    whose shape is the full parameter's, with the shard-level ops below them)."""
    shards = {}
    for op in trace.ops:
        if op.name == "aten::_foreach_copy_" and op.module.startswith("FSDP::all_gather"):
            for t in op.inputs[1].value:  # copy_(bf16 views of the gather input, shards)
                shards[t.storage_id] = (t.numel, t.dtype)
    return shards


@pytest.fixture(scope="module")
def fsdp2_fake_4(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp2_fake_4")
    return out, fake_capture(out, 4)


def test_bf16_mixed_fsdp2_holds_fp32_shards_and_gathers_bf16(fsdp2_fake_4):
    out, meta = fsdp2_fake_4
    trace = load_trace(out / trace_file_name(0))
    shapes = example_shapes({})
    assert meta["num_params"] == sum(math.prod(s) for s in shapes)
    assert meta["workload"]["device"] == "fake" and meta["iteration_time_s"] is None
    assert meta["memory"]["method"].startswith("not measured")
    # fp32 shards: one fp32 storage of rank 0's shard size per parameter.
    shards = param_shards(trace).values()
    assert {dtype for _, dtype in shards} == {"float32"}
    assert sorted(n for n, _ in shards) == sorted(rank0_shard_numel(s, 4) for s in shapes)
    # bf16 gathered parameters: every all-gather moves bf16, gradients reduce in fp32.
    kinds = Counter((op.collective.kind, op.collective.dtype) for op in trace.collectives)
    assert kinds == {("all_gather_into_tensor", "bfloat16"): 5,  # root, 2 layers, again 2 layers
                     ("reduce_scatter_tensor", "float32"): 3}
    gathered = [op.output_tensors()[0] for op in trace.ops
                if op.name == "fsdp::all_gather_copy_in"]
    assert {t.dtype for t in gathered} == {"bfloat16"}
    # The forward's gathers cover each parameter once, padded to whole shards.
    forward = [op.collective.out_nelems for op in trace.collectives
               if op.collective.kind == "all_gather_into_tensor"][:3]
    assert sum(forward) == 4 * sum(rank0_shard_numel(s, 4) for s in shapes)
    modules = {op.module for op in trace.ops}
    assert {"FSDP::all_gather (layers.0)", "FSDP::post_backward_reduce (layers.1)"} <= modules


def test_fake_traces_name_storages_like_real_ones(fsdp2_fake_4):
    """Distinct tensors get distinct storage ids: every parameter shard its own, and every
    allocation a storage id no earlier tensor of the trace had."""
    out, _ = fsdp2_fake_4
    trace = load_trace(out / trace_file_name(0))
    assert len(param_shards(trace)) == len(example_shapes({}))  # one storage id each
    seen, num_allocs = set(), 0
    for op in trace.ops:
        if op.name in ALLOCATING:
            for t in op.output_tensors():
                assert t.storage_id not in seen, (op, t.storage_id)
                num_allocs += 1
        seen.update(t.storage_id for t in op.input_tensors() + op.output_tensors())
    assert num_allocs >= 10
    assert 0 not in seen
    with unique_meta_storages(), CaptureFakeMode():
        a, b = torch.empty(4), torch.empty(4)
        ptrs = [t.untyped_storage().data_ptr() for t in (a, b, a[1:])]
        assert a.device.type == "cpu" and ptrs[0] != ptrs[1] and ptrs[2] == ptrs[0]


def test_fake_world_far_beyond_the_machine(tmp_path, monkeypatch):
    """64 ranks of a ~1.07B-parameter model (4 blocks 4096 wide): 17 GB of fp32 parameters,
    gradients and AdamW state for one real rank alone. Rank 0's shards are numel / 64."""
    env = {"EXAMPLE_DIM": "4096", "EXAMPLE_LAYERS": "4", "EXAMPLE_HEADS": "32",
           "EXAMPLE_VOCAB": "32000", "EXAMPLE_SEQ": "128", "EXAMPLE_BATCH": "1"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    meta = fake_capture(tmp_path, 64)
    shapes = example_shapes(env)
    assert 1.0e9 < meta["num_params"] == sum(math.prod(s) for s in shapes) < 1.1e9
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss < 2 * 2**20  # KiB
    trace = load_trace(tmp_path / trace_file_name(63))
    shards = param_shards(trace).values()
    assert sorted(n for n, _ in shards) == sorted(rank0_shard_numel(s, 64) for s in shapes)
    assert all(s[0] % 64 == 0 for s in shapes)  # so every shard is exactly numel / 64
    assert sum(n for n, _ in shards) * 64 == meta["num_params"]
    assert [g.group_size for g in trace.process_groups] == [64]


def test_builtin_llama_on_fake_is_the_meta_program(tmp_path):
    """The built-in workloads run on fake through build_workload: the same ops and all-reduces
    as on meta (both accumulate repeated gradients out of place, as subclass-like tensors)."""
    cfg = CaptureConfig(workload=WorkloadConfig(**{**SMALL_LLAMA, "device": "fake"}),
                        world_size=2, out_dir=str(tmp_path / "fake"))
    run_capture_job(cfg)
    meta_capture(tmp_path / "meta", 2)
    fake, meta = (load_trace(tmp_path / d / trace_file_name(1)) for d in ("fake", "meta"))
    assert Counter(op.name for op in fake.ops) == Counter(op.name for op in meta.ops)
    assert [op.collective.signature() for op in fake.collectives] == \
        [op.collective.signature() for op in meta.collectives]
    assert {t.device for op in fake.ops for t in op.input_tensors()} == {"cpu"}


def test_deepspeed_on_fake_is_refused_clearly():
    """(DDP runs on fake: tests/capture/test_fake_ddp.py.)"""
    with pytest.raises(ConfigError, match="runs DeepSpeed, which needs real tensors"):
        CaptureConfig(workload=WorkloadConfig(kind="gpt_zero3", device="fake")).validate()


def test_fake_trace_keeps_subclass_work_and_drops_the_modes(fsdp2_fake_4):
    """No node of the fake mode's own is left (its frames, meta kernels); the frames where
    DTensor ran its local ops are named ``PythonSubclass``, as on a real device, and hold the
    optimizer's update of each fp32 shard."""
    out, _ = fsdp2_fake_4
    with gzip.open(out / trace_file_name(0)) as f:
        nodes = orjson.loads(f.read())["nodes"]
    by_id = {n["id"]: n for n in nodes}
    assert not [n for n in nodes if n["name"] == DISPATCH_MODE_NODE]
    # the run's recorded frees, and the wrappers' id once, name storages by zero-size meta
    # views (free_markers.py, wrapper_marker.py)
    markers = (FREED_OP, WRAPPER_STORAGE_OP)
    freed = [n for n in nodes if n["name"] == FREED_OP]
    assert freed and {d for n in freed for d in _devices(n)} == {"meta"}
    assert [_devices(n) for n in nodes if n["name"] == WRAPPER_STORAGE_OP] == [["meta"]]
    devices = {d for n in nodes if n["name"] not in markers for d in _devices(n)}
    assert devices == {"cpu", ""}  # "": an optional tensor argument left out (None)
    frames = [n for n in nodes if n["name"] == SUBCLASS_NODE]
    assert frames and all(by_id[f["ctrl_deps"]]["name"].startswith("aten::") for f in frames)
    local_updates = [n for n in nodes if n["name"] == "aten::addcdiv_"
                     and by_id[n["ctrl_deps"]]["name"] == SUBCLASS_NODE]
    shard_numels = sorted(rank0_shard_numel(s, 4) for s in example_shapes({}))
    assert sorted(n["inputs"]["values"][0][3] for n in local_updates) == shard_numels
    assert len({n["inputs"]["values"][0][1] for n in local_updates}) == len(shard_numels)


def test_fake_parameters_survive_module_to():
    """nn.Module._apply swaps fake parameters, which fails on a weakly referenced tensor: the
    capture's mode keeps fresh outputs unreferenced, so users' .to() calls work on fake."""
    with unique_meta_storages(), CaptureFakeMode():
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
        model = model.to(torch.device("cpu")).to(torch.bfloat16)
        assert {(p.device.type, p.dtype) for p in model.parameters()} == {("cpu", torch.bfloat16)}
        assert model(torch.randn(2, 8, dtype=torch.bfloat16)).shape == (2, 8)


def test_fake_fsdp2_unsharded_parameters_are_a_generation_per_all_gather(fsdp2_fake_4):
    """On fake, FSDP2's resize keeps an unsharded parameter's storage id from forward to
    backward: each copy-out still starts a new generation (made in the iteration), so the
    dry run does not hold every block's gathered parameters at once."""
    trace = load_trace(fsdp2_fake_4[0] / trace_file_name(0))
    generations, storage_ids = set(), Counter()
    for op in trace.ops:
        if op.name == "fsdp::split_with_sizes_copy":
            for arg in op.inputs:
                if getattr(arg, "kind", None) == "tensor_list":
                    for t in arg.value:
                        generations.add(t.suid)
                        storage_ids[t.storage_id] += 1
                        assert t.suid in trace.made_inside
    reused = [sid for sid, n in storage_ids.items() if n > 1]
    assert reused  # the same storage id gathered in forward and again in backward
    assert len(generations) == sum(storage_ids.values())  # one generation per gather
