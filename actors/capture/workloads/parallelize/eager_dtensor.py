"""DTensor on the fake device, as it runs eagerly on a real one.

DTensor asks ``_are_we_tracing()`` before using its caches, and that answers yes whenever a
fake tensor mode is active ("if fake mode is turned on, we are almost definitely
compiling"). Under the capture's fake mode DTensor would then re-run sharding propagation for
every op, and propagation runs the op again on global-shaped fake tensors of the active
mode: ops of the whole logits or activations, which a real run never executes (there it is
cached after the first call and, when not, runs under a private fake mode the trace does not
mix with the local work). :func:`eager_dtensor` makes DTensor's modules see an eager run
(torch.compile's and make_fx's own checks still apply). Functional collectives keep theirs:
eagerly they return an AsyncCollectiveTensor, a wrapper whose storage the trace cannot follow.

DTensor's caches key on the mesh's layout, which is every rank's: a second rank recorded in
the same process (another role) would get the first one's redistribution plans, on the first
one's process groups. They are cleared when the block ends.
"""
from __future__ import annotations

import importlib
from contextlib import contextmanager

# DTensor's modules that import _are_we_tracing from _functional_collectives
_MODULES = ("torch.distributed.tensor._dispatch", "torch.distributed.tensor._sharding_prop",
            "torch.distributed.tensor._decompositions",
            "torch.distributed.tensor._collective_utils")


def _eager_are_we_tracing() -> bool:
    """``_are_we_tracing`` without its fake-mode answer."""
    import torch
    from torch.compiler import is_compiling
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    if is_compiling():
        return True
    if torch._C._dispatch_tls_is_dispatch_key_included(torch._C.DispatchKey.PythonDispatcher):
        return True
    return get_proxy_mode() is not None


@contextmanager
def eager_dtensor():
    """Within the block, DTensor caches its sharding propagation as in eager mode."""
    modules = [importlib.import_module(name) for name in _MODULES]
    saved = [m._are_we_tracing for m in modules]
    for m in modules:
        m._are_we_tracing = _eager_are_we_tracing
    try:
        yield
    finally:
        for m, original in zip(modules, saved):
            m._are_we_tracing = original
        _clear_caches()


def _clear_caches() -> None:
    """DTensor's sharding-propagation and redistribution caches (see the module docstring)."""
    from torch.distributed.tensor._collective_utils import MeshTopoInfo
    from torch.distributed.tensor._redistribute import _gen_transform_infos
    from torch.distributed.tensor._sharding_prop import ShardingPropagator
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    _gen_transform_infos.cache_clear()
    ShardingPropagator._propagate_tensor_meta_cached.cache_clear()
    MeshTopoInfo.build_from_mesh.cache_clear()
