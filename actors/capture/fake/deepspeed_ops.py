"""DeepSpeed's CPU shared-memory comm op, not built for a fake capture.

DeepSpeed's torch backend JIT-compiles this op as it starts (``deepspeed.initialize`` in a
user's step: 30-90 s of g++ in a fresh environment) when ``deepspeed.ops.__compatible_ops__``
says it can. The op only speeds up a real run's intra-node all-reduces; a fake capture runs
none. Within :func:`no_shm_comm_build` the op is marked incompatible, so DeepSpeed skips it, as
``workload.build_shm_op=false`` makes the built-in ZeRO-3 workload do
(actors/capture/workloads/zero3.py): in ``deepspeed.ops`` if it is imported, else as it is.
"""
from __future__ import annotations

import importlib.abc
import sys
from contextlib import contextmanager

_OPS = "deepspeed.ops"
_SHM_COMM = "deepspeed_shm_comm"  # ShareMemCommBuilder.NAME


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds ``name`` with the other finders and runs ``then(module)`` once it is executed."""

    def __init__(self, name: str, then):
        self.name, self.then = name, then

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                execute = spec.loader.exec_module

                def exec_then(module):
                    execute(module)
                    self.then(module)

                spec.loader.exec_module = exec_then
                return spec
        return None


def _skip(ops) -> None:
    ops.__compatible_ops__[_SHM_COMM] = False


@contextmanager
def no_shm_comm_build():
    """Within the block, DeepSpeed does not build its shm comm op (see the module docstring)."""
    ops = sys.modules.get(_OPS)
    before = None if ops is None else ops.__compatible_ops__.get(_SHM_COMM)
    if ops is not None:
        _skip(ops)
    finder = _AfterImport(_OPS, _skip)
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)
        ops = sys.modules.get(_OPS)
        if ops is not None and before is not None:  # as it was (a later real run builds it)
            ops.__compatible_ops__[_SHM_COMM] = before
