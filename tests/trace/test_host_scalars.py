"""Python numbers an op was called with are host scalars, not storages
(actors/trace/host_scalars.py); a 0-dim tensor the step made stays a tensor."""
from __future__ import annotations

import torch
from torch.profiler import ExecutionTraceObserver

from actors.trace.host_scalars import HOST_SCALAR
from actors.trace.liveness import compute_liveness
from actors.trace.loader import load_trace
from actors.trace.model import TensorArg


def _record(path, step) -> None:
    et = ExecutionTraceObserver()
    et.register_callback(str(path))
    et.start()
    step()
    et.stop()
    et.unregister_callback()


def _step():
    x = torch.randn(4, 8)
    y = x * 0.5  # a float: wrapped as float64
    y + 2  # an int: wrapped as int64
    torch.arange(4) * 3
    y * torch.tensor(0.5, dtype=torch.float64)  # a real 0-dim float64 tensor: made by the step


def test_python_numbers_carry_no_storage(tmp_path):
    path = tmp_path / "rank-0.et.json"
    _record(path, _step)
    trace = load_trace(path)
    scalars = [(op.name, a.value) for op in trace.ops for a in op.inputs
               if type(a) is not TensorArg and a.kind == HOST_SCALAR]
    assert scalars == [("aten::mul", "float64"), ("aten::add", "int64"), ("aten::mul", "int64")]
    assert trace.meta["num_host_scalars"] == 3
    # the tensor torch.tensor made is still one, on the storage its making returned
    last_mul = [op for op in trace.ops if op.name == "aten::mul"][-1]
    made = last_mul.inputs[1]
    assert type(made) is TensorArg and made.shape == () and made.dtype == "float64"
    assert any(t.storage_id == made.storage_id for op in trace.ops[:last_mul.index]
               for t in op.output_tensors())
    # no 0-dim float64/int64 storage is left but that one
    live = compute_liveness(trace.ops, trace.num_storages)
    small = [s for s, nbytes in enumerate(live.storage_bytes) if nbytes == 8]
    assert small == [made.suid]
