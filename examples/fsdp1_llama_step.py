"""A user's FSDP1 training step (``FullyShardedDataParallel``, flat parameters): a small
Llama-style transformer, bf16 MixedPrecision, AdamW, each block its own FSDP unit.

FSDP1 is what HF Trainer, Accelerate's FSDP plugin and many scripts wrap a model in::

    tracefleet-predict workload=custom workload.entrypoint=examples/fsdp1_llama_step.py:build \\
        world_size=8 target=h100_80gb

Sizes and knobs come from the environment (tiny by default): EXAMPLE_DIM, EXAMPLE_LAYERS,
EXAMPLE_HEADS, EXAMPLE_VOCAB, EXAMPLE_SEQ, EXAMPLE_BATCH; EXAMPLE_STRATEGY (FULL_SHARD,
SHARD_GRAD_OP, HYBRID_SHARD or NO_SHARD), EXAMPLE_ORIG_PARAMS (use_orig_params, 1 or 0),
EXAMPLE_LIMIT_ALL_GATHERS (1 or 0).
"""
import functools
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecision, ShardingStrategy
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy


def _size(name: str, default: int) -> int:
    return int(os.environ.get(f"EXAMPLE_{name}", default))


class Block(nn.Module):
    """Pre-norm decoder block: causal self-attention and a SwiGLU feed-forward."""

    def __init__(self, dim: int, n_heads: int):
        super().__init__()
        hidden = 64 * -(-8 * dim // 3 // 64)
        self.n_heads = n_heads
        self.attention_norm = nn.RMSNorm(dim)
        self.wqkv = nn.Linear(dim, 3 * dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.ffn_norm = nn.RMSNorm(dim)
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        qkv = self.wqkv(self.attention_norm(x)).view(b, t, 3, self.n_heads, d // self.n_heads)
        q, k, v = (z.transpose(1, 2) for z in qkv.unbind(2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(y.transpose(1, 2).reshape(b, t, d))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Transformer(nn.Module):
    def __init__(self, vocab: int, dim: int, n_layers: int, n_heads: int):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, n_heads) for _ in range(n_layers))
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx):
        x = self.tok_embeddings(idx)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


def build(ctx):
    """(model, make_batch, step) on ctx.device, wrapped in FSDP1 over the default group."""
    vocab, dim = _size("VOCAB", 512), _size("DIM", 64)
    seq, batch = _size("SEQ", 32), _size("BATCH", 2)
    torch.manual_seed(0)
    with torch.device(ctx.device):
        model = Transformer(vocab, dim, _size("LAYERS", 2), _size("HEADS", 4))
    strategy = ShardingStrategy[os.environ.get("EXAMPLE_STRATEGY", "FULL_SHARD")]
    model = FSDP(model, sharding_strategy=strategy,
                 auto_wrap_policy=functools.partial(transformer_auto_wrap_policy,
                                                    transformer_layer_cls={Block}),
                 mixed_precision=MixedPrecision(param_dtype=torch.bfloat16,
                                                reduce_dtype=torch.float32,
                                                buffer_dtype=torch.float32),
                 use_orig_params=bool(_size("ORIG_PARAMS", 1)),
                 limit_all_gathers=bool(_size("LIMIT_ALL_GATHERS", 1)),
                 device_id=ctx.device)  # FSDP1 runs on cpu only when told so
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def make_batch():
        tokens = torch.randint(0, vocab, (batch, seq + 1), device=ctx.device)
        return tokens[:, :-1], tokens[:, 1:]

    def step(batch):
        idx, targets = batch
        logits = model(idx)
        loss = F.cross_entropy(logits.float().reshape(-1, vocab), targets.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return model, make_batch, step
