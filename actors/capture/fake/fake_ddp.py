"""``DistributedDataParallel(model, ...)`` as the user wrote it, on ``workload.device=fake``.

DDP's Python runs unchanged; within :func:`ddp_on_fake` the three C++ pieces it calls that
need real tensors and a real process group are stood in for:

* ``dist.Reducer``: :class:`actors.capture.fake.fake_reducer.FakeReducer` (buckets, hooks, the
  all-reduces, the copies: what the real reducer holds, frees and communicates);
* ``dist.Logger``: :class:`_FakeLogger`, DDP's usage logger: nothing to log, and the one
  place every comm hook and ``join()`` passes through, so they are refused there by name;
* ``_verify_param_shape_across_processes``: it checks that the ranks built the same
  parameter shapes, writing them through raw data pointers (a fake tensor's point nowhere);
  on fake every rank is rank 0's program: nothing to check.

The construction-time broadcast of parameters and buffers (``_sync_module_states``) and the
per-forward buffer broadcast run as they are (``dist._broadcast_coalesced`` runs on fake
tensors over the fake group, recorded as on a real device).

Refused, with a ConfigError naming it: comm hooks (``register_comm_hook``, the built-in
ones, DDP's ``mixed_precision`` and optimizer-in-backward, which install one), ``join()`` and
the ``Join`` context (uneven inputs), sparse gradients, ``skip_all_reduce_unused_params``,
``batched_grad_copy``, ``bucket_cap_mb_list``, and any other reducer method.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch.distributed as dist

from actors.capture.fake.fake_reducer import LIVE, FakeReducer, refused


class _FakeLogger:
    """``dist.Logger(reducer)``: DDP's construction/runtime usage logging, a no-op here."""

    def __init__(self, reducer):
        self.reducer = reducer

    def set_construction_data_and_log(self, *args, **kwargs) -> None:
        pass

    def set_runtime_stats_and_log(self) -> None:
        pass

    def set_error_and_log(self, message) -> None:
        pass  # DDP raises the error itself right after

    def _set_static_graph(self) -> None:
        pass

    def _get_ddp_logging_data(self) -> dict:
        return {}

    def _set_comm_hook_name(self, name) -> None:
        raise refused(f"a communication hook ({name}; DDP's mixed_precision and "
                      "optimizer-in-backward install one too; only the default all-reduce, no "
                      "hook, is modelled)")

    def _set_uneven_input_join(self) -> None:
        raise refused("join() and the Join context (uneven inputs)")

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        raise refused(f"the usage logger's {name}()")


def _no_shape_check(process_group, tensors, logger=None) -> None:
    """Every rank of a fake capture runs rank 0's program: their shapes agree."""


@contextmanager
def ddp_on_fake():
    """Within the block, ``DistributedDataParallel`` builds the fake reducer (see the module
    docstring); the originals are restored after."""
    import torch.nn.parallel.distributed as ddp_module

    patches = [(dist, "Reducer", FakeReducer), (dist, "Logger", _FakeLogger),
               (ddp_module, "_verify_param_shape_across_processes", _no_shape_check)]
    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    for owner, name, value in patches:
        setattr(owner, name, value)
    LIVE.clear()  # an earlier capture's models are none of this one's
    try:
        yield
    finally:
        LIVE.clear()
        for owner, name, value in originals:
            setattr(owner, name, value)
