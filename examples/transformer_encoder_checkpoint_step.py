"""A user's step with ``torch.nn`` built-ins: a language model of ``nn.TransformerEncoderLayer``
blocks (``nn.MultiheadAttention`` inside, pre-norm, GELU, a causal mask with the ``is_causal``
hint), each block under ``torch.utils.checkpoint`` (non-reentrant, torch's defaults), the
whole model moved with the everyday ``.to(device)``, FSDP2 over the blocks, AdamW.

    tracefleet-capture workload=custom \\
        workload.entrypoint=examples/transformer_encoder_checkpoint_step.py:build world_size=2

Sizes come from the environment (tiny by default): EXAMPLE_DIM, EXAMPLE_LAYERS, EXAMPLE_HEADS,
EXAMPLE_VOCAB, EXAMPLE_SEQ, EXAMPLE_BATCH.
"""
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.utils.checkpoint import checkpoint


def _size(name: str, default: int) -> int:
    return int(os.environ.get(f"EXAMPLE_{name}", default))


class EncoderLM(nn.Module):
    """Token embedding, learned positions, encoder blocks, a final norm and the vocabulary head."""

    def __init__(self, vocab: int, dim: int, layers: int, heads: int, seq: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(seq, dim))
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(dim, heads, dim_feedforward=4 * dim, dropout=0.0,
                                       activation="gelu", batch_first=True, norm_first=True)
            for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids):
        seq = ids.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(seq, device=ids.device)
        x = self.embed(ids) + self.pos[:seq]
        for block in self.blocks:
            x = checkpoint(block, x, mask, None, True, use_reentrant=False)
        return self.head(self.norm(x))


def build(ctx):
    """(model, make_batch, step) on ctx.device, every block and the root sharded."""
    dim, vocab = _size("DIM", 64), _size("VOCAB", 512)
    seq, batch = _size("SEQ", 32), _size("BATCH", 2)
    torch.manual_seed(0)
    model = EncoderLM(vocab, dim, _size("LAYERS", 2), _size("HEADS", 4), seq).to(ctx.device)
    for block in model.blocks:
        fully_shard(block, mesh=ctx.mesh)
    fully_shard(model, mesh=ctx.mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def make_batch():
        tokens = torch.randint(0, vocab, (batch, seq + 1), device=ctx.device)
        return tokens[:, :-1], tokens[:, 1:]

    def step(batch):
        ids, targets = batch
        logits = model(ids)
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return model, make_batch, step
