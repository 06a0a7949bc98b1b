"""The ``workload.device=fake`` tensor mode: a training step runs on shapes only, on a device
that looks like the real one.

Under ``FakeTensorMode`` every tensor is a ``FakeTensor``: it reports the real device
(``cpu``) but is backed by a ``meta`` tensor, so nothing is computed or allocated and a model
far larger than the machine trains at any world size. Unlike plain ``meta`` tensors, FSDP2
accepts fake ones. Two things keep the ET observer's trace shaped like a real one:

* Every op under a Python dispatch mode runs inside a ``PythonDispatchMode`` RecordFunction
  (torch's ``pythonFallback``), with the mode's own meta kernels below it:
  :func:`strip_dispatch_mode_nodes` removes them from the written trace. And
  ``record_function`` ranges are themselves ops: their start would open inside that wrapper
  and close outside it, so the observer would nest nothing under them (no
  ``ProfilerStep#``, no module ranges). :func:`ranges_outside_fake_mode` starts and ends them
  below the Python dispatch keys, as on a real device.
* ``FakeTensorMode`` memoizes every fresh op output with a weak reference, and
  ``nn.Module._apply`` always swaps a fake parameter (``torch.utils.swap_tensors``), which
  refuses a tensor with a weak reference: ``model.to(device)`` would fail on fake. The
  memo only serves to map a tensor seen twice to one fake tensor, and a fresh output is
  never seen again, so :class:`CaptureFakeMode` wraps fresh outputs without it.

Storage ids: a fake tensor's storage is its meta tensor's, whose data pointer is 0 unless
:func:`actors.capture.meta_storage.unique_meta_storages` is active (it is, during a fake
capture), so the trace names storages as a real one does.

DistributedDataParallel does not run on fake tensors: :func:`refuse_ddp` says so clearly.
"""
from __future__ import annotations

import gzip
from contextlib import contextmanager

import orjson
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorConverter, FakeTensorMode

from actors.errors import ConfigError

DISPATCH_MODE_NODE = "PythonDispatchMode"  # torch's pythonFallback RecordFunction
_PYTHON_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.Python) | torch._C.DispatchKeySet(
    torch._C.DispatchKey.PythonTLSSnapshot)


class _FreshOutputConverter(FakeTensorConverter):
    """Wraps an op's fresh meta output without memoizing it (see the module docstring)."""

    def from_meta_and_device(self, fake_mode, t, device, pytype=None, dispatch_keys=None):
        return FakeTensor(fake_mode, t, device, pytype=pytype, dispatch_keys=dispatch_keys)


class CaptureFakeMode(FakeTensorMode):
    """``FakeTensorMode`` whose parameters survive ``module.to(device)``."""

    def __init__(self):
        super().__init__()
        self.fake_tensor_converter = _FreshOutputConverter()


@contextmanager
def ranges_outside_fake_mode():
    """Within the block, ``record_function`` ranges start and end below the Python dispatch
    keys, so the ET observer nests the ops they span under them (see the module docstring)."""
    cls = torch.autograd.profiler.record_function
    enter, exit_ = cls.__enter__, cls.__exit__

    def guarded_enter(self):
        with torch._C._ExcludeDispatchKeyGuard(_PYTHON_KEYS):
            return enter(self)

    def guarded_exit(self, *exc):
        with torch._C._ExcludeDispatchKeyGuard(_PYTHON_KEYS):
            return exit_(self, *exc)

    cls.__enter__, cls.__exit__ = guarded_enter, guarded_exit
    try:
        yield
    finally:
        cls.__enter__, cls.__exit__ = enter, exit_


@contextmanager
def refuse_ddp():
    """Within the block, wrapping a model in ``DistributedDataParallel`` raises ConfigError.

    DDP's C++ side writes its parameter-shape check through raw data pointers (a fake
    tensor's points nowhere: a segfault) and expects its all-reduce futures to carry
    tensors (the fake process group's carry none), so it cannot run on fake tensors. Its
    constructor's first check is where it is stopped, with a message instead of a crash.
    """
    import torch.nn.parallel.distributed as ddp_module

    original = ddp_module._verify_param_shape_across_processes

    def refuse(*args, **kwargs):
        raise ConfigError("DistributedDataParallel cannot run on workload.device=fake (its C++ "
                          "reducer needs real tensors and a real process group); capture it on "
                          "cpu or cuda, or shard with FSDP2 (fully_shard), which runs on fake")

    ddp_module._verify_param_shape_across_processes = refuse
    try:
        yield
    finally:
        ddp_module._verify_param_shape_across_processes = original


def _meta_only(node: dict) -> bool:
    """Whether every tensor the node reads or writes is on ``meta`` (and it has one)."""
    devices = [v[5] for side in (node["inputs"], node["outputs"])
               for v, t in zip(side["values"], side["types"])
               if t.startswith("Tensor") and isinstance(v, list) and len(v) == 6]
    return bool(devices) and all(d == "meta" for d in devices)


def strip_dispatch_mode_nodes(path: str) -> int:
    """Drop the fake mode's own work from the gzipped trace at ``path``; returns how many
    nodes went.

    That is every ``PythonDispatchMode`` node with the meta kernels under it (one below each
    op, see the module docstring), and the meta ops the mode runs outside any op (re-wrapping
    a tensor saved for backward when autograd unpacks it): every tensor of the workload
    reports the real device, so an op on ``meta`` tensors only is the mode's. A real
    device's trace has none of them, and the inner ``c10d::*`` kernels would read as extra
    collectives (the loader treats a collective nested under another as an op of its own).
    """
    with gzip.open(path, "rb") as f:
        doc = orjson.loads(f.read())
    parent = {n["id"]: n["ctrl_deps"] for n in doc["nodes"]}
    wrapper = {n["id"] for n in doc["nodes"] if n["name"] == DISPATCH_MODE_NODE or _meta_only(n)}
    dropped: dict[int, bool] = {}

    def under_wrapper(nid: int) -> bool:
        chain = []
        while nid not in dropped and nid not in wrapper and nid in parent \
                and parent[nid] != nid and len(chain) <= len(parent):
            chain.append(nid)
            nid = parent[nid]
        verdict = dropped.get(nid, nid in wrapper)
        for seen in chain:
            dropped[seen] = verdict
        return verdict

    kept = [n for n in doc["nodes"] if not under_wrapper(n["id"])]
    removed = len(doc["nodes"]) - len(kept)
    doc["nodes"] = kept
    with gzip.open(path, "wb", compresslevel=6) as f:
        f.write(orjson.dumps(doc))
    return removed
