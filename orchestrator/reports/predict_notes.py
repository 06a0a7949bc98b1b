"""The notes a prediction carries beside its figures, for the console and prediction.html:
what each breakdown category holds, and which ops ran as the target GPU's kernels rather
than the CPU's (actors/capture/fake/cuda_dispatch.py's ``kernel_dispatch`` records)."""
from __future__ import annotations

from actors.trace.categories import CATEGORY_HELP
from orchestrator.units import human_bytes

_KERNEL_NAMES = {"flash": "CUDA's flash attention", "efficient": "CUDA's memory-efficient "
                 "attention", "math": "the math path (no fused CUDA kernel takes it)",
                 "cpu_flash": "the CPU's flash kernel", "cpu_math": "the CPU's math path",
                 "native_dropout": "CUDA's fused dropout",
                 "mul by noise": "the CPU's dropout (a multiply by a noise tensor)",
                 "foreach": "torch.optim's multi-tensor (foreach) kernels",
                 "fused": "torch.optim's fused kernel",
                 "for-loop": "torch.optim's single-tensor for-loop",
                 "disabled (no CUDA)": "no autocast at all (torch disables a cuda region "
                                       "where CUDA is absent)",
                 "triton_flex": "inductor's Triton FlexAttention kernel",
                 "no CPU backward": "nothing (torch has no CPU kernel for FlexAttention's "
                                    "backward)"}
# what each op's kernel keeps, and what the CPU's path makes in its place
_KEPT = {"aten::scaled_dot_product_attention": ("logsumexp and RNG state",
                                                "float32 L x S score matrices (one per call; "
                                                "it keeps several)"),
         "aten::dropout": ("one-byte masks", "noise tensors of the input's dtype"),
         "flex_attention (compiled)": ("float32 rows (the logsumexp; backward's delta)",
                                       "bytes")}


def breakdown_help(breakdown: dict) -> dict[str, str]:
    """``{category: what it holds}`` for the categories with bytes in ``breakdown``."""
    return {name: CATEGORY_HELP[name] for name, b in breakdown.items()
            if b and name in CATEGORY_HELP}


def kernel_lines(records: list[dict] | None) -> list[str]:
    """One line per kernel_dispatch record: the calls, the kernel, what it keeps, and what
    the CPU's path would have made instead."""
    lines = []
    for r in records or ():
        kept, instead = _KEPT.get(r["op"], ("bytes", "bytes"))
        line = (f"kernels: {r['num_calls']} x {r['op']} ({r['detail']}) ran as "
                f"{_KERNEL_NAMES.get(r['kernel'], r['kernel'])} on {r['arch']}")
        if r["kept_bytes"]:
            line += f", keeping {human_bytes(r['kept_bytes'])} of {kept}"
        if r["cpu_bytes"]:
            line += (f"; {_KERNEL_NAMES.get(r['cpu_kernel'], r['cpu_kernel'])} would have "
                     f"made {human_bytes(r['cpu_bytes'])} of {instead}")
        elif r["cpu_kernel"] != r["kernel"]:
            line += f"; the CPU would have run {_KERNEL_NAMES.get(r['cpu_kernel'], 'its own')}"
        lines.append(line)
    return lines


def outside_breakdown(p: dict) -> list[tuple[str, str]]:
    """What the allocated peak holds beyond the trace's tensors, so not in the breakdown (of
    the accounted peak): the cuBLAS workspace the target's first matmul allocates."""
    workspace = (p.get("target") or {}).get("cublas_workspace_bytes")
    return [("of which cuBLAS workspace*", f"{human_bytes(workspace)} (not a tensor of the "
                                           "trace: not in the breakdown)")] if workspace else []
