"""A Mixture-of-Experts feed-forward for the built-in Llama (Mixtral / DeepSeek-like), as
torchtitan's MoE computes it, with expert parallel's all-to-all dispatch and combine.

Per block: a router (a Linear gate, softmax scores in float32) picks ``top_k`` of
``num_experts`` SwiGLU experts per token; tokens are sorted by expert, every expert's share
runs through one grouped matmul per weight (``torch._grouped_mm`` over the experts' stacked
weights, in bf16 as torchtitan runs them), the outputs are scaled by the router's scores and
summed back per token; DeepSeek's shared experts (a SwiGLU every token runs) add theirs.

Expert parallel (``ep`` ranks, actors/capture/workloads/parallelize/expert_parallel.py) holds
``num_experts / ep`` experts per rank: the per-expert token counts are exchanged first (an
all-to-all of ``num_experts`` integers), then the tokens go to the ranks of their experts
(an all-to-all of the sorted tokens, split by destination), are reordered from rank-major to
expert-major, run, reordered back and return by the reverse all-to-all.

The routing assumption. Which expert a token goes to depends on the data: the counts, hence
the all-to-all split sizes and every expert's batch, are values the router computes from
floats, which have no value on fake or meta (the fake device gives values to integer tensors
computed from known ones only: actors/capture/readable.py). Where the counts are computed and the
router's choice has no value, :func:`assumed_loads` stands for it: expert 0 (the hot one)
gets ``(1 + skew)`` times the mean load (``workload.moe_routing_skew``; 0 = balanced), the
others share the rest equally, and every rank routes its tokens alike, so the counts a rank
receives from each peer are its own counts for its experts. ``router=fixed`` imposes the
same loads on a real run (a deterministic assignment realizing them, torchtitan's
``_debug_force_load_balance`` at skew 0), so a real run and its fake capture route alike.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from actors.capture.readable import readable
from actors.capture.workloads.swiglu import SwiGLU
from actors.choices import Choice


class MoeScore(Choice):
    """How the gate's logits become the experts' scores."""

    softmax = "softmax"  # Mixtral, Qwen3-MoE, DeepSeek-MoE 16B
    sigmoid = "sigmoid"  # DeepSeek-V3: each expert scored alone, the chosen ones renormalized


class MoeRouter(Choice):
    """How a token's experts are chosen (see the module docstring)."""

    topk = "topk"  # the gate's top_k scores (token choice; on fake: the routing assumption)
    fixed = "fixed"  # the routing assumption's loads imposed, real runs included


@dataclass(frozen=True)
class MoeSpec:
    """An MoE block's shape (WorkloadConfig's moe_* fields)."""

    num_experts: int
    top_k: int
    hidden: int  # each expert's SwiGLU hidden size
    num_shared: int  # shared experts (one SwiGLU of num_shared x hidden), 0 = none
    router: MoeRouter
    skew: float
    # the chosen experts' scores renormalized to sum to 1 per token (Qwen3-MoE's norm_topk_prob)
    normalize_top_k: bool = False
    score: MoeScore = MoeScore.softmax
    # node-limited routing (DeepSeek-V3): the experts in num_groups groups (one per node), a
    # token's top_k chosen within its limited_groups best groups; 0 = no groups
    num_groups: int = 0
    limited_groups: int = 0


def assumed_loads(num_tokens: int, top_k: int, num_experts: int, skew: float) -> list[int]:
    """Tokens per expert under the routing assumption: expert 0 gets ``(1 + skew)`` times the
    mean (at most every token), the others the rest, as evenly as integers allow."""
    total = num_tokens * top_k
    if skew == 0 or num_experts == 1:
        return [total // num_experts + (i < total % num_experts) for i in range(num_experts)]
    hot = min(num_tokens, round(total * (1 + skew) / num_experts))
    rest, extra = divmod(total - hot, num_experts - 1)
    return [hot] + [rest + (i < extra) for i in range(num_experts - 1)]


def max_skew(top_k: int, num_experts: int) -> float:
    """The largest skew: the hot expert then takes every token."""
    return num_experts / top_k - 1


def fixed_assignment(loads: list[int], num_tokens: int, top_k: int) -> torch.Tensor:
    """``(num_tokens, top_k)`` expert ids realizing ``loads``: the experts' slots laid out
    one after the other and dealt to tokens column by column; an expert's at most
    ``num_tokens`` consecutive slots fall on distinct tokens, so a token's experts differ."""
    slots = torch.repeat_interleave(torch.arange(len(loads)), torch.tensor(loads))
    return slots.view(top_k, num_tokens).t().contiguous()


class GroupedExperts(nn.Module):
    """Experts' SwiGLU weights stacked ``(experts, out, in)``; one grouped matmul per weight."""

    def __init__(self, num_experts: int, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        for w in (self.w1, self.w2, self.w3):
            nn.init.normal_(w, std=0.02)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``x`` (tokens sorted by expert, dim), ``counts`` tokens per (local) expert."""
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)
        xb = x.bfloat16()
        h = F.silu(torch._grouped_mm(xb, self.w1.bfloat16().transpose(-2, -1), offs=offsets))
        h = h * torch._grouped_mm(xb, self.w3.bfloat16().transpose(-2, -1), offs=offsets)
        return torch._grouped_mm(h, self.w2.bfloat16().transpose(-2, -1),
                                 offs=offsets).type_as(x)


class MoE(nn.Module):
    """The feed-forward of an MoE block (see the module docstring)."""

    def __init__(self, dim: int, spec: MoeSpec):
        super().__init__()
        self.spec = spec
        self.gate = nn.Linear(dim, spec.num_experts, bias=False)
        self.experts = GroupedExperts(spec.num_experts, dim, spec.hidden)
        self.shared = SwiGLU(dim, spec.hidden * spec.num_shared) if spec.num_shared else None
        self.ep_group = None  # expert parallel's process group (expert_parallel.py)
        self.ep_rank, self.ep_size = 0, 1

    def forward(self, x):
        b, t, dim = x.shape
        tokens = x.reshape(-1, dim)
        num_tokens, k = tokens.shape[0], self.spec.top_k
        logits = self.gate(tokens).float()
        scores = F.softmax(logits, dim=-1) if self.spec.score == MoeScore.softmax \
            else torch.sigmoid(logits)
        if self.spec.router == MoeRouter.fixed:
            ids = fixed_assignment(self._loads(num_tokens), num_tokens, k).to(x.device)
        else:
            ids = torch.topk(self._group_limited(scores), k, dim=-1).indices
        weights = scores.gather(-1, ids)
        if self.spec.normalize_top_k or self.spec.score == MoeScore.sigmoid:
            weights = weights / weights.sum(-1, keepdim=True)
        counts = self._token_counts(ids, num_tokens)
        order = torch.argsort(ids.view(-1), stable=True)
        token_of = order // k
        routed = tokens[token_of]
        if self.ep_group is None:
            out = self.experts(routed, counts)
        else:
            out = self._expert_parallel(routed, counts)
        out = (out.float() * weights.view(-1)[order].unsqueeze(-1)).type_as(out)
        y = torch.zeros_like(tokens).index_add_(0, token_of, out)
        if self.shared is not None:
            y = y + self.shared(tokens)
        return y.view(b, t, dim)

    def _group_limited(self, scores: torch.Tensor) -> torch.Tensor:
        """The scores a token's top-k is chosen from: with groups, those outside the token's
        ``limited_groups`` best groups (a group scored by its two best experts, DeepSeek-V3's
        rule) are zeroed; the routing assumption's loads are the same either way."""
        spec = self.spec
        if not spec.num_groups:
            return scores
        n = scores.shape[0]
        grouped = scores.view(n, spec.num_groups, -1)
        best = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
        keep = torch.zeros_like(best).scatter_(1, best.topk(spec.limited_groups, dim=-1).indices,
                                               1.0)
        return (grouped * keep.unsqueeze(-1)).view(n, -1)

    def _loads(self, num_tokens: int) -> list[int]:
        spec = self.spec
        return assumed_loads(num_tokens, spec.top_k, spec.num_experts, spec.skew)

    def _token_counts(self, ids: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """Tokens per expert: counted from the router's choice, or, where that has no value
        (fake, meta), the routing assumption's."""
        if not readable(ids):
            return torch.tensor(self._loads(num_tokens), device=ids.device)
        return torch.bincount(ids.view(-1), minlength=self.spec.num_experts)

    def _expert_parallel(self, routed: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Dispatch to the experts' ranks, run this rank's experts, combine back."""
        import torch.distributed._functional_collectives as funcol

        ep, group = self.ep_size, self.ep_group
        local = self.spec.num_experts // ep
        with torch.no_grad():
            received = funcol.wait_tensor(funcol.all_to_all_single(counts, None, None, group))
            if not readable(received):
                # the routing assumption: every peer routes as this rank does
                received = counts.view(ep, local)[self.ep_rank].repeat(ep)
            matrix = received.view(ep, local)  # tokens from rank r for local expert e
            input_splits = counts.view(ep, local).sum(1).tolist()
            output_splits = matrix.sum(1).tolist()
            permuted, local_counts = _expert_major(matrix)
        routed = funcol.all_to_all_single(routed, output_splits, input_splits, group)
        routed = routed[permuted]
        out = self.experts(routed, local_counts)
        unpermuted = torch.empty_like(out)
        unpermuted[permuted] = out
        return funcol.all_to_all_single(unpermuted, input_splits, output_splits, group)


def _expert_major(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices reordering received tokens from rank-major ``(r0 e0, r0 e1, .., r1 e0, ..)``
    to expert-major ``(e0 r0, e0 r1, .., e1 r0, ..)``, and the tokens per local expert."""
    ep, local = matrix.shape
    flat = matrix.reshape(-1)
    starts = (flat.cumsum(0) - flat).view(ep, local).t().reshape(-1)
    lengths = matrix.t().reshape(-1)
    segment = torch.repeat_interleave(torch.arange(ep * local, device=matrix.device), lengths)
    out_starts = lengths.cumsum(0) - lengths
    position = torch.arange(segment.shape[0], device=matrix.device)
    return starts[segment] + position - out_starts[segment], matrix.sum(0)
