"""A user's FSDP2 step over ``nn.TransformerEncoder`` with torch's defaults (dropout 0.1 in
attention and around it), bf16 mixed precision, AdamW.

On a GPU, ``nn.MultiheadAttention`` calls ``scaled_dot_product_attention``, which runs a fused
kernel that supports dropout and keeps nothing of size seq x seq; on a CPU, dropout sends it to
the math path. A prediction for a GPU target runs the GPU's choice (docs/capture.md, "CPU and
CUDA paths")::

    tracefleet-predict workload=custom \\
        workload.entrypoint=examples/fsdp2_transformer_encoder_step.py:build \\
        world_size=8 target=h100_80gb

Sizes come from the environment (tiny by default): EXAMPLE_DIM, EXAMPLE_LAYERS, EXAMPLE_HEADS,
EXAMPLE_VOCAB, EXAMPLE_SEQ, EXAMPLE_BATCH, EXAMPLE_DROPOUT (default 0.1, torch's) and
EXAMPLE_ATTN_DROPOUT (the attention's own, inside the fused kernel; default EXAMPLE_DROPOUT).
"""
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


def _env(name: str, default):
    return type(default)(os.environ.get(f"EXAMPLE_{name}", default))


class EncoderLM(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int, dropout: float):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=dropout,
                                           batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx):
        return self.head(self.encoder(self.embed(idx)))


def build(ctx):
    """(model, make_batch, step) on ctx.device, each encoder layer and the model sharded."""
    vocab, dim, seq, batch = _env("VOCAB", 512), _env("DIM", 64), _env("SEQ", 32), _env("BATCH", 2)
    torch.manual_seed(0)
    with torch.device(ctx.device):
        model = EncoderLM(vocab, dim, _env("LAYERS", 2), _env("HEADS", 4), _env("DROPOUT", 0.1))
    for layer in model.encoder.layers:
        layer.self_attn.dropout = _env("ATTN_DROPOUT", layer.self_attn.dropout)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.encoder.layers:
        fully_shard(layer, mesh=ctx.mesh, mp_policy=mp)
    fully_shard(model, mesh=ctx.mesh, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def make_batch():
        tokens = torch.randint(0, vocab, (batch, seq + 1), device=ctx.device)
        return tokens[:, :-1], tokens[:, 1:]

    def step(batch):
        idx, targets = batch
        loss = F.cross_entropy(model(idx).float().reshape(-1, vocab), targets.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return model, make_batch, step
