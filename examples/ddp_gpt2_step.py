"""A user's DDP step: Hugging Face GPT-2 (``GPT2LMHeadModel``), bf16 autocast, gradient
accumulation over two micro-batches with ``no_sync``, AdamW.

    tracefleet-capture workload=custom workload.entrypoint=examples/ddp_gpt2_step.py:build \\
        world_size=2
    tracefleet-capture workload=custom workload.entrypoint=examples/ddp_gpt2_step.py:build \\
        workload.device=fake world_size=64

The model is a ``GPT2LMHeadModel`` of a small ``GPT2Config``, fp32 parameters, wrapped in
``DistributedDataParallel``; each micro-batch's forward runs under ``torch.autocast`` (bf16 on
the device's type), the first micro-batch's backward under ``ddp.no_sync()`` (gradients
accumulate, no all-reduce), the second's all-reduces them. Needs ``transformers``. Sizes from
the environment (tiny by default): EXAMPLE_DIM, EXAMPLE_LAYERS, EXAMPLE_HEADS, EXAMPLE_VOCAB,
EXAMPLE_SEQ, EXAMPLE_BATCH (per micro-batch).
"""
import os

import torch
from torch.nn.parallel import DistributedDataParallel
from transformers import GPT2Config, GPT2LMHeadModel

NUM_MICRO_BATCHES = 2


def _size(name: str, default: int) -> int:
    return int(os.environ.get(f"EXAMPLE_{name}", default))


def build(ctx):
    """(DDP-wrapped model, make_batch, step) on ctx.device."""
    vocab, seq, batch = _size("VOCAB", 512), _size("SEQ", 32), _size("BATCH", 2)
    config = GPT2Config(vocab_size=vocab, n_positions=seq, n_embd=_size("DIM", 64),
                        n_layer=_size("LAYERS", 2), n_head=_size("HEADS", 4))
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config).to(ctx.device)
    ddp = DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4)

    def make_batch():
        return [torch.randint(0, vocab, (batch, seq), device=ctx.device)
                for _ in range(NUM_MICRO_BATCHES)]

    def micro_step(ids):
        with torch.autocast(ctx.device.type, dtype=torch.bfloat16):
            loss = ddp(input_ids=ids, labels=ids).loss
        (loss / NUM_MICRO_BATCHES).backward()

    def step(micro_batches):
        *first, last = micro_batches
        with ddp.no_sync():
            for ids in first:
                micro_step(ids)
        micro_step(last)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return ddp, make_batch, step
