"""Value reads on fake whose answer the capture knows: libraries' overflow checks.

A mixed-precision optimizer reads a flag it computed from the gradients (``.item()``) to decide
whether to step: DeepSpeed's ZeRO optimizers (stage 1 and 2, stage 3), its fp16 and bf16
optimizers, whether the global gradient norm is finite, and the norm itself where it is read
(1.0: logged, or the clipping coefficient of an in-place scale that runs either way). On fake the flag has no value. The step a capture records is the one with finite
gradients, the one that updates the weights and holds the optimizer's memory (as GradScaler's
found-inf flags read 0: actors/capture/fake/fake_idioms.py), so a read made inside one of these
functions answers "no overflow"; the check's own ops (the isinf/isnan reductions, the flag's
all-reduce) run and are recorded as on cpu. Any other read stays refused.
"""
from __future__ import annotations

import os
import sys

NO_OVERFLOW = 0
# (the library file, relative to site-packages, the function that reads): the answer
KNOWN_READS = {
    (os.path.join("deepspeed", "runtime", "zero", "stage_1_and_2.py"), "has_overflow"):
        NO_OVERFLOW,
    (os.path.join("deepspeed", "runtime", "zero", "stage3.py"), "has_overflow"): NO_OVERFLOW,
    (os.path.join("deepspeed", "runtime", "fp16", "fused_optimizer.py"), "has_overflow"):
        NO_OVERFLOW,
    (os.path.join("deepspeed", "runtime", "fp16", "unfused_optimizer.py"), "has_overflow"):
        NO_OVERFLOW,
    (os.path.join("deepspeed", "runtime", "base_optimizer.py"), "has_overflow"): NO_OVERFLOW,
    # CheckOverflow (ZeRO stage 0's bf16 / fp16 optimizers)
    (os.path.join("deepspeed", "runtime", "utils.py"), "has_overflow"): NO_OVERFLOW,
    # norms read for logging and the clipping coefficient (an in-place scale either way)
    (os.path.join("deepspeed", "runtime", "utils.py"), "get_weight_norm"): 1.0,
    (os.path.join("deepspeed", "runtime", "utils.py"), "get_grad_norm"): 1.0,
    # the global gradient norm checked for inf / nan / negative before the step
    (os.path.join("deepspeed", "runtime", "utils.py"), "is_invalid_grad_norm"): False,
}
_DEPTH = 12  # frames looked at above the read (the op's dispatch, then the library's code)


def known_answer():
    """The answer to the value read now being made, when a function of KNOWN_READS makes it
    (within _DEPTH frames); None otherwise."""
    frame = sys._getframe(1)
    for _ in range(_DEPTH):
        if frame is None:
            return None
        code = frame.f_code
        for (path, function), answer in KNOWN_READS.items():
            if code.co_name == function and code.co_filename.endswith(os.sep + path):
                return answer
        frame = frame.f_back
    return None
