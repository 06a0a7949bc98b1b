"""The ``workload.device=fake`` tensor mode: a training step runs on shapes only, on a device
that looks like the real one.

Under ``FakeTensorMode`` every tensor is a ``FakeTensor``: it reports the real device
(``cpu``) but is backed by a ``meta`` tensor, so nothing is computed or allocated and a model
far larger than the machine trains at any world size. Unlike plain ``meta`` tensors, FSDP2
accepts fake ones. Two things keep the ET observer's trace shaped like a real one:

* Every op under a Python dispatch mode runs inside a ``PythonDispatchMode`` RecordFunction
  (torch's ``pythonFallback``), with the mode's own meta kernels below it:
  :func:`strip_dispatch_mode_nodes` removes them from the written trace (or renames the
  frame where a tensor subclass such as DTensor ran its local ops under it). And
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

DistributedDataParallel runs on fake over a stand-in for its C++ reducer:
:mod:`actors.capture.fake_ddp`.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorConverter, FakeTensorMode

from actors.trace.tensor_ids import UNIQUE_STORAGES_KEY

DISPATCH_MODE_NODE = "PythonDispatchMode"  # torch's pythonFallback frame under a mode
SUBCLASS_NODE = "PythonSubclass"  # its frame for a tensor subclass without a mode
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


def _devices(node: dict) -> list[str]:
    """The device of every tensor (also in tensor lists) the node reads or writes."""
    devices = []
    for side in (node["inputs"], node["outputs"]):
        for value, type_ in zip(side["values"], side["types"]):
            if type_.startswith("Tensor(") and isinstance(value, list) and len(value) == 6:
                devices.append(value[5])
            elif type_.startswith("GenericList") and isinstance(value, list):
                devices += [v[5] for v in value if isinstance(v, list) and len(v) == 6]
    return devices


def strip_dispatch_mode_nodes(doc: dict) -> int:
    """Make the fake trace ``doc`` (the parsed ET, edited in place) read like a real device's;
    returns how many nodes were dropped.

    * Ops on ``meta`` tensors go, with everything under them: every tensor of the workload
      reports the real device, so they are the fake mode's own kernels (below each op; a
      Python number's 0-dim tensor stays a real cpu one there) or its re-wrapping of a tensor
      saved for backward when autograd unpacks it.
    * A ``PythonDispatchMode`` frame (one below each op, see the module docstring) goes too,
      unless the op runs again under it on real-device tensors: then a tensor subclass
      (DTensor: FSDP2's sharded parameters and their optimizer state) dispatched its local
      call there, which a real device records under a ``PythonSubclass`` frame, and it is
      renamed so. (Under other frames, the mode's decompositions run other ops: dropped.)

    A real trace has none of the dropped nodes, and their inner ``c10d::*`` kernels would read
    as extra collectives (the loader treats a collective nested under another as an op).
    """
    nodes = doc["nodes"]
    parent = {n["id"]: n["ctrl_deps"] for n in nodes}
    devices = {n["id"]: _devices(n) for n in nodes}
    name = {n["id"]: n["name"] for n in nodes}
    # Frames holding the op itself again on real-device tensors: a subclass's local call
    # (the mode's decompositions run other ops, e.g. view for _unsafe_view).
    subclass_frames = {parent[nid] for nid, devs in devices.items()
                       if "meta" not in devs and any(devs)
                       and name.get(parent.get(parent[nid])) == name[nid]}
    wrapper = set()
    for n in nodes:
        if "meta" in devices[n["id"]]:
            wrapper.add(n["id"])
        elif n["name"] == DISPATCH_MODE_NODE:
            if n["id"] in subclass_frames:
                n["name"] = SUBCLASS_NODE
            else:
                wrapper.add(n["id"])
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

    kept = [n for n in nodes if not under_wrapper(n["id"])]
    removed = len(nodes) - len(kept)
    doc["nodes"] = kept
    doc[UNIQUE_STORAGES_KEY] = True  # meta_storage's addresses: none handed out twice
    return removed
