"""Python numbers an op was called with: host scalars, not device memory.

``x + 1e-6`` reaches the dispatcher with the number wrapped in a 0-dim CPU tensor (float64,
int64, bool or complex128 for a float, int, bool or complex), which the observer records like
any tensor. It stays on the host whatever the device (a GPU kernel takes it by value), and each
call makes a new one wherever malloc puts it. Counted as storages they charged a device that
never held them, and in a fake or meta capture, where every device storage has an address of
its own, whether two calls' numbers shared a storage id depended on the heap: the prediction
moved by a few KiB from one capture of the same step to the next.

An input is such a number when it is a 0-dim CPU tensor of one of those dtypes whose storage
was last returned by an earlier op, if at all, as something else: a tensor the step made
(``torch.tensor(3)`` included) is an earlier op's output of its own shape and dtype, while a
number may land on the address of any freed tensor, whose storage id the observer then reuses.
:func:`mark_host_scalars` turns each into ``Arg(HOST_SCALAR, dtype name)``: no tensor id, no
storage, nothing charged; the replay passes a CPU scalar (actors/replay/step_plan.py). A number
on a freed 0-dim tensor's address of its own dtype stays a tensor, as every number was before.
"""
from __future__ import annotations

from actors.trace.model import Arg, Op, TensorArg

HOST_SCALAR = "host_scalar"  # the Arg kind of a wrapped Python number
_PYTHON_NUMBER_DTYPES = frozenset({"float64", "int64", "bool", "complex128"})


def mark_host_scalars(ops: list[Op]) -> int:
    """Replace every wrapped Python number among the ops' inputs by a host-scalar Arg (in
    place, ops in execution order); returns how many were replaced."""
    made: dict[int, tuple] = {}  # storage id -> (dtype, shape) of the last output on it
    num_marked = 0
    for op in ops:
        numbers = [i for i, a in enumerate(op.inputs) if _is_number(a, made)]
        if numbers:
            inputs = list(op.inputs)
            for i in numbers:
                inputs[i] = Arg(HOST_SCALAR, inputs[i].dtype, f"Tensor({inputs[i].dtype})")
            op.inputs = tuple(inputs)
            num_marked += len(numbers)
        for t in op.output_tensors():
            made[t.storage_id] = (t.dtype, t.shape)
    return num_marked


def _is_number(arg, made: dict[int, tuple]) -> bool:
    return (type(arg) is TensorArg and arg.shape == () and arg.device == "cpu"
            and arg.dtype in _PYTHON_NUMBER_DTYPES
            and made.get(arg.storage_id) != (arg.dtype, ()))
