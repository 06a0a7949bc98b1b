"""The ``workload.device=fake`` tensor mode: a training step runs on shapes only, on a device
that looks like the real one.

Under ``FakeTensorMode`` every tensor is a ``FakeTensor``: it reports the real device
(``cpu``) but is backed by a ``meta`` tensor, so nothing is computed or allocated and a model
far larger than the machine trains at any world size. Unlike plain ``meta`` tensors, FSDP2
accepts fake ones. What keeps the ET observer's trace shaped like a real one:

* Every op under a Python dispatch mode runs inside a ``PythonDispatchMode`` RecordFunction
  (torch's ``pythonFallback``), and the mode then does its own work: meta kernels,
  decompositions, and constant propagation, which reruns the op (and a ``clone``) on *real* cpu
  tensors for small values it tracks (``torch.tensor(1.0)``, an optimizer's step count).
  :meth:`CaptureFakeMode.dispatch` does that work with RecordFunction off, so none of it is
  recorded (constant propagation's real-tensor ops would otherwise read as a tensor subclass's
  local call, below, and add ops a real run does not have: a foreach optimizer's
  ``torch.tensor(1.0)`` step added a ``clone``). :func:`strip_dispatch_mode_nodes` removes the
  frames themselves (or renames the frame where a tensor subclass such as DTensor ran its
  local ops under it) and any ``meta`` node left. And ``record_function`` ranges are
  themselves ops: their start would open inside that frame and close outside it, so the
  observer would nest nothing under them (no ``ProfilerStep#``, no module ranges).
  :func:`ranges_outside_fake_mode` starts and ends them below the Python dispatch keys, as
  on a real device.
* ``FakeTensorMode`` memoizes every fresh op output with a weak reference, and
  ``nn.Module._apply`` always swaps a fake parameter (``torch.utils.swap_tensors``), which
  refuses a tensor with a weak reference: ``model.to(device)`` would fail on fake. The
  memo only serves to map a tensor seen twice to one fake tensor, and a fresh output is
  never seen again, so :class:`CaptureFakeMode` wraps fresh outputs without it.
* A FakeTensor keeps its mode in its ``__dict__``, which ``copy.deepcopy`` copies: every
  deep-copied module (``nn.TransformerEncoder`` clones its layer ``num_layers`` times, an EMA
  copy of the model) got tensors of a mode of their own, and the first op mixing them with
  the capture's failed ("Mixing fake modes"; through ``model.to(device)``: ``_apply():
  Couldn't swap <Module>.weight``). The capture's mode deep-copies as itself.

The idioms torch branches on for fake tensors (foreach paths, GradScaler's found-inf check,
value reads): actors/capture/fake/fake_idioms.py.

Storage ids: a fake tensor's storage is its meta tensor's, whose data pointer is 0 unless
:func:`actors.capture.fake.meta_storage.unique_meta_storages` is active (it is, during a fake
capture), so the trace names storages as a real one does.

DistributedDataParallel runs on fake over a stand-in for its C++ reducer:
:mod:`actors.capture.fake.fake_ddp`. An op making a sparse tensor raises :class:`SparseOnFake`
(actors/capture/fake/fake_idioms.py names it).
"""
from __future__ import annotations

import threading
from contextlib import contextmanager

import torch
from torch._higher_order_ops.utils import registered_hop_fake_fns
from torch._ops import HigherOrderOperator
from torch._subclasses import fake_tensor
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorConverter, FakeTensorMode
from torch.utils._pytree import arg_tree_leaves

from actors.capture.fake import free_markers
from actors.capture.fake.known_reads import known_answer
from actors.capture.fake.fake_values import UNANSWERED, KnownValues
from actors.trace.conventions import FREED_OP, WRAPPER_STORAGE_OP
from actors.trace.tensor_ids import UNIQUE_STORAGES_KEY

_WAIT_TENSOR = torch.ops._c10d_functional.wait_tensor.default
DISPATCH_MODE_NODE = "PythonDispatchMode"  # torch's pythonFallback frame under a mode
SUBCLASS_NODE = "PythonSubclass"  # its frame for a tensor subclass without a mode
_UNRECORDED = threading.local()  # depth of CaptureFakeMode.dispatch calls on this thread
_ANSWERS = threading.local()  # the pending answer of answering_next_read, on this thread
_SPARSE_LAYOUTS = (torch.sparse_coo, torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr,
                   torch.sparse_bsc)
_PYTHON_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.Python) | torch._C.DispatchKeySet(
    torch._C.DispatchKey.PythonTLSSnapshot)
# a tensor's device, sizes, strides: FakeTensorMode answers them before anything else
_METADATA_QUERIES = fake_tensor._DISPATCH_META_HANDLERS
# the ops FakeTensorMode runs itself whatever tensor subclass they read, and the value reads
# the capture answers (answering_next_read)
_ANSWERED_FOR_SUBCLASSES = frozenset([*fake_tensor._DISPATCH_HANDLE_DIRECTLY,
                                      torch.ops.aten._local_scalar_dense.default])


class SparseOnFake(RuntimeError):
    """An op made a sparse tensor on fake: its number of stored elements (``nnz``) depends on
    values, so the fake one's is made up (a coalesced gradient's is 0: the optimizer then skips
    the update, silently)."""

    def __init__(self, func):
        super().__init__(f"{func} made a sparse tensor on fake")
        self.func = func


class _FreshOutputConverter(FakeTensorConverter):
    """Wraps an op's fresh meta output without memoizing it (see the module docstring)."""

    def from_meta_and_device(self, fake_mode, t, device, pytype=None, dispatch_keys=None):
        return FakeTensor(fake_mode, t, device, pytype=pytype, dispatch_keys=dispatch_keys)


class CaptureFakeMode(FakeTensorMode):
    """``FakeTensorMode`` that records none of its own work, whose parameters survive
    ``module.to(device)`` and ``deepcopy``, whose small tensors computed from known data carry
    their values (actors/capture/fake/fake_values.py), that writes the run's frees into the trace
    while recording (actors/capture/fake/free_markers.py) and refuses sparse tensors
    (SparseOnFake)."""

    # torch looks a higher-order op's rule up by the mode's exact type: FakeTensorMode's rules
    # (run_and_save_rng_state in inductor's wrappers, checkpoint's tags) reach this subclass
    # through __torch_dispatch__
    supports_higher_order_operators = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        metadata = _METADATA_QUERIES.get(func)
        if metadata is not None:
            # A FakeTensor's device is dispatched, so C++ code reading it (autograd, every
            # kernel's device check) comes here: most of a step's dispatches. No op of the
            # trace: answered before the mode's own work, which would run for each. The frees
            # are still written here, between the ops they fell between (written at the next
            # op instead, they would be read as that op's, a step later).
            if self.emit_frees and not getattr(_UNRECORDED, "depth", 0):
                free_markers.emit()
            return metadata(args)
        if isinstance(func, HigherOrderOperator):
            # a real tensor among a higher-order op's inputs is the host's RNG state
            # (run_and_save_rng_state returns torch.get_rng_state() on cpu): made fake here
            args = tuple(self.from_tensor(a) if type(a) is torch.Tensor else a for a in args)
        if isinstance(func, HigherOrderOperator) and func not in registered_hop_fake_fns:
            # a rule given as py_impl(FakeTensorMode); register_fake's go through dispatch
            rule = func.python_key_table.get(FakeTensorMode)
            if rule is None:
                raise NotImplementedError(f"the fake device has no rule for the higher-order "
                                          f"op {func.name()} (nor has torch's FakeTensorMode)")
            return rule(self, *args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)

    def __init__(self):
        super().__init__()
        self.fake_tensor_converter = _FreshOutputConverter()
        self.values = KnownValues()
        self.emit_frees = False  # free_markers.recording(mode) turns it on

    def dispatch(self, func, types, args=(), kwargs=None):
        """The mode's own work for one op, with no RecordFunction (see the module docstring);
        nested calls (decompositions re-enter the mode) leave it off until the outer one ends.
        A value read inside :func:`answering_next_read` gets its answer; one of a known value
        gets that value. An op on a tensor subclass (a DTensor) is handed to the subclass at
        once: FakeTensorMode would too, after building a cache key for it and failing (a third
        of a tensor-parallel step's dispatches), and the subclass's local ops come back here."""
        depth = getattr(_UNRECORDED, "depth", 0)
        writes_frees = depth == 0 and self.emit_frees
        if any(t is not FakeTensor for t in types) and func not in _ANSWERED_FOR_SUBCLASSES \
                and fake_tensor._check_for_subclass(arg_tree_leaves(*args, **(kwargs or {}))):
            if writes_frees:  # before the subclass's op, as below
                free_markers.emit()
            return NotImplemented
        if writes_frees:  # recorded: before the mode's own work
            start = free_markers.op_begins()
        answers = getattr(_ANSWERS, "pending", None)
        if func is torch.ops.aten._local_scalar_dense.default:
            if answers:
                return answers.pop(0)
            known = known_answer()  # a library's overflow flag (actors/capture/fake/known_reads.py)
            if known is not None:
                return known
        kwargs = kwargs or {}
        if func is _WAIT_TENSOR:
            # eagerly a wait returns its input's storage; the fake kernel would make another
            # one (twice the result's bytes at the wait, and both kept where both are held)
            func, args, kwargs = torch.ops.aten.alias.default, args[:1], {}
        if depth == 0:
            torch._C._autograd._enable_record_function(False)
        _UNRECORDED.depth = depth + 1
        try:
            out = self.values.before(self, func, args, kwargs)
            if out is UNANSWERED:
                out = super().dispatch(func, types, args, kwargs)
                if depth == 0:  # the user's op; inside, the mode's own (meta-filled) tensors
                    self.values.after(func, args, kwargs, out)
        finally:
            _UNRECORDED.depth = depth
            if depth == 0:
                torch._C._autograd._enable_record_function(True)
            if writes_frees:
                free_markers.op_ends(start)
        if isinstance(out, torch.Tensor) and out.layout in _SPARSE_LAYOUTS:
            raise SparseOnFake(func)
        return out

    def __deepcopy__(self, memo):
        # A FakeTensor keeps its mode in __dict__, which Tensor.__deepcopy__ deep-copies: each
        # copied tensor would get a mode of its own, and the first op mixing it with the
        # capture's tensors fails ("Mixing fake modes"). The mode is the capture's state, not
        # the tensor's: a copy stays in it.
        return self


@contextmanager
def answering_next_read(value):
    """Within the block, the first read of a fake tensor's value (``.item()``, ``bool()``: the
    op ``aten::_local_scalar_dense``, recorded as on a real device) returns ``value``: for an
    idiom whose answer the capture knows without the data (actors/capture/fake/fake_idioms.py).
    The block must read exactly once."""
    if getattr(_ANSWERS, "pending", None):
        raise AssertionError("answering_next_read blocks do not nest")
    _ANSWERS.pending = [value]
    try:
        yield
        if _ANSWERS.pending:
            raise AssertionError("the block read no value")
    finally:
        _ANSWERS.pending = None


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

    * The run's recorded frees (FREED_OP, actors/capture/fake/free_markers.py) stay, moved under
      their nearest kept ancestor (they are written from inside the mode's frame).
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
    markers = (FREED_OP, WRAPPER_STORAGE_OP)  # on meta views, yet the run's own
    freed = [n for n in nodes if n["name"] in markers]
    for n in nodes:
        if n["name"] in markers:
            continue
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

    for n in freed:  # below the nearest ancestor that stays
        anchor = n["ctrl_deps"]
        while anchor in parent and under_wrapper(anchor) and parent[anchor] != anchor:
            anchor = parent[anchor]
        n["ctrl_deps"] = anchor
        dropped[n["id"]] = False
    kept = [n for n in nodes if not under_wrapper(n["id"])]
    removed = len(nodes) - len(kept)
    doc["nodes"] = kept
    doc[UNIQUE_STORAGES_KEY] = True  # meta_storage's addresses: none handed out twice
    return removed
