"""Record one training iteration of one rank with torch's ExecutionTraceObserver.

The trace follows the conventions in :mod:`actors.capture`: the iteration runs inside a
``ProfilerStep#<n>`` range, every module call inside a ``## module:<qualname> ##`` range,
and each module's backward between ``## module_bwd_begin/end:<qualname> ##`` markers (from
full backward hooks), so a replayer can tell which parameters each stretch of operators
uses. Integral input tensors carry their value range (``tensor_range`` attr) so index ops
replay with valid indices.
"""
from __future__ import annotations

import gzip
import os
import shutil
import warnings
from typing import Callable

import torch.nn as nn
from torch.profiler import ExecutionTraceObserver, record_function

from actors.capture import BWD_BEGIN, BWD_END, STEP_PREFIX, module_range_name

# Read by the observer when it registers: any value turns tensor ranges on.
TENSOR_RANGE_ENV = "ENABLE_PYTORCH_EXECUTION_TRACE_SAVE_INTEGRAL_TENSOR_RANGE"


def _mark(name: str) -> None:
    """A zero-length record_function node: a position in execution order."""
    with record_function(name):
        pass


class ModuleRanges:
    """Context manager: name every module call of ``model`` in the trace.

    Forward pre hooks are prepended so the range also covers whatever other pre hooks do
    (e.g. ZeRO-3 parameter fetch); post hooks are appended (covering the release). The
    root module gets no backward markers: they would bracket nothing.
    """

    def __init__(self, model: nn.Module, backward: bool = True):
        self.model = model
        self.backward = backward
        self._handles = []
        self._open: dict[int, list] = {}  # id(module) -> open forward ranges

    def _enter(self, key: int, name: str) -> None:
        self._open.setdefault(key, []).append(record_function(name).__enter__())

    def _exit(self, key: int) -> None:
        self._open[key].pop().__exit__(None, None, None)

    def __enter__(self):
        for qualname, module in self.model.named_modules():
            key, name = id(module), module_range_name(qualname)
            self._handles += [
                module.register_forward_pre_hook(
                    lambda m, a, k=key, n=name: self._enter(k, n), prepend=True),
                module.register_forward_hook(lambda m, a, o, k=key: self._exit(k)),
            ]
            if self.backward and module is not self.model:
                begin, end = (module_range_name(qualname, kind) for kind in (BWD_BEGIN, BWD_END))
                self._handles += [
                    module.register_full_backward_pre_hook(lambda m, g, n=begin: _mark(n)),
                    module.register_full_backward_hook(lambda m, gi, go, n=end: _mark(n)),
                ]
        return self

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        # Ranges left open (an exception mid-forward) are closed innermost first.
        for ranges in self._open.values():
            while ranges:
                ranges.pop().__exit__(None, None, None)
        return False


def record_iteration(step: Callable[[tuple], None], batch: tuple, model: nn.Module,
                     step_index: int, out_path: str, module_backward: bool = True) -> str:
    """Run ``step(batch)`` once under the ET observer and write the gzipped trace to out_path.

    The batch is made before the observer starts: data loading is not part of the step.
    """
    os.environ[TENSOR_RANGE_ENV] = "1"  # must precede register_callback()
    raw_path = out_path[:-len(".gz")] if out_path.endswith(".gz") else out_path + ".json"
    raw_path += ".partial"
    observer = ExecutionTraceObserver()
    observer.register_callback(raw_path)
    try:
        with ModuleRanges(model, backward=module_backward), warnings.catch_warnings():
            # Expected for embeddings (see the module docstring), not worth a warning per rank.
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            observer.start()
            with record_function(f"{STEP_PREFIX}{step_index}"):
                step(batch)
            observer.stop()
    finally:
        observer.unregister_callback()  # finalizes the JSON
    with open(raw_path, "rb") as src, gzip.open(out_path, "wb", compresslevel=6) as dst:
        shutil.copyfileobj(src, dst)
    os.remove(raw_path)
    return out_path
