"""The CUDA architecture a capture dispatches for (``sm90`` = compute capability 9.0).

Shared ground: the capture picks kernels by it (actors/capture/fake/sdpa_choice.py) and the target
(actors/replay/memory/target.py) names its product's. Only the architectures whose rules differ
in torch's kernel selection are listed (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp:
sm86-89 and sm120-121 restrict flash attention's backward, sm90 and sm10x widen cuDNN's).
"""
from __future__ import annotations

from actors.choices import Choice


class GpuArch(Choice):
    """A CUDA compute capability: ``sm<major><minor>``."""

    sm80 = "sm80"  # A100
    sm86 = "sm86"  # A10, RTX 30xx, A40
    sm89 = "sm89"  # L4, L40, RTX 40xx
    sm90 = "sm90"  # H100, H200, GH200
    sm100 = "sm100"  # B200, GB200
    sm120 = "sm120"  # RTX 50xx, RTX PRO 6000

    @property
    def capability(self) -> tuple[int, int]:
        """``(major, minor)``, e.g. (9, 0)."""
        digits = self.value[2:]
        return int(digits[:-1]), int(digits[-1])
