"""A user's DeepSpeed training step: the engine from ``deepspeed.initialize`` with the user's own
config (ZeRO stage, bf16, buckets), on a small Llama-style transformer.

    tracefleet-predict workload=custom \\
        workload.entrypoint=examples/deepspeed_llama_step.py:build world_size=8 target=h100_80gb

Sizes and knobs come from the environment (tiny by default): EXAMPLE_DIM, EXAMPLE_LAYERS,
EXAMPLE_HEADS, EXAMPLE_VOCAB, EXAMPLE_SEQ, EXAMPLE_BATCH; EXAMPLE_ZERO_STAGE (0, 1, 2; 3 is
tracefleet's ZeRO-3 recipe or emulation), EXAMPLE_PRECISION (bf16, fp16 or fp32),
EXAMPLE_BUCKET (reduce_bucket_size and allgather_bucket_size, elements), EXAMPLE_READ_LOSS=1
prints the loss every step.
"""
import os

import deepspeed
import torch
import torch.nn as nn
import torch.nn.functional as F


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

    def forward(self, idx, targets):
        x = self.tok_embeddings(idx)
        for layer in self.layers:
            x = layer(x)
        logits = self.output(self.norm(x))
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def build(ctx):
    """(engine, make_batch, step): the model under DeepSpeed's engine on ctx's group."""
    vocab, dim = _size("VOCAB", 512), _size("DIM", 64)
    seq, batch = _size("SEQ", 32), _size("BATCH", 2)
    precision = os.environ.get("EXAMPLE_PRECISION", "bf16")
    bucket = _size("BUCKET", 500_000_000)
    torch.manual_seed(0)
    model = Transformer(vocab, dim, _size("LAYERS", 2), _size("HEADS", 4)).to(ctx.device)
    config = {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
        "zero_optimization": {"stage": _size("ZERO_STAGE", 2), "reduce_bucket_size": bucket,
                              "allgather_bucket_size": bucket, "overlap_comm": False,
                              "contiguous_gradients": True},
        "bf16": {"enabled": precision == "bf16"},
        "fp16": {"enabled": precision == "fp16", "initial_scale_power": 8},
        "steps_per_print": 2**31 - 1,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=config, dist_init_required=False)

    def make_batch():
        tokens = torch.randint(0, vocab, (batch, seq + 1), device=ctx.device)
        return tokens[:, :-1], tokens[:, 1:]

    log_loss = bool(_size("READ_LOSS", 0))

    def step(batch):
        loss = engine(*batch)
        engine.backward(loss)
        engine.step()
        if log_loss:  # what a training loop logs
            print(f"loss {loss.item():.3f}")

    return engine, make_batch, step
