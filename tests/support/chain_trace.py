"""A three-op trace whose memory is known by hand, for the sweep and search tests."""
from __future__ import annotations

from pathlib import Path

import torch

N = 1024  # float32 elements per tensor: 4096 B each
TENSOR_BYTES = 4 * N


def capture_chain(path: Path) -> Path:
    """y = relu(x); z = y + x; w = relu(z) on 1024 floats, x created before the trace.

    By hand (4096 B per tensor): lazy and faithful hold at most x, y and z together (at the
    add): 12288 B, the liveness bound. pre_allocate keeps x and every intermediate to the
    end of the iteration: x, y, z and w, 16384 B.
    """
    from torch.profiler import ExecutionTraceObserver

    x = torch.ones(N)
    et = ExecutionTraceObserver()
    et.register_callback(str(path))
    et.start()
    (x.relu() + x).relu()
    et.stop()
    et.unregister_callback()
    return path
