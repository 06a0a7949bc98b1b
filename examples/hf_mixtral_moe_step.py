"""A user's Hugging Face MoE step: transformers ``MixtralForCausalLM`` (a router and top-2 of
its experts per token) under FSDP2, SGD with momentum, gradient clipping and two micro-batches
of gradient accumulation (no reduce-scatter on the first).

    tracefleet-capture workload=custom workload.entrypoint=examples/hf_mixtral_moe_step.py:build \\
        world_size=2

The experts run transformers' ``batched_mm`` implementation: every expert's weights are
gathered per selected token, so no shape depends on the routing (the ``eager`` loop over the
experts a token chose asks ``nonzero()`` of the router's output, which fake tensors cannot
answer; ``grouped_mm`` takes bf16 only on CPU). Sizes come from the environment (tiny by
default): EXAMPLE_DIM, EXAMPLE_LAYERS, EXAMPLE_HEADS, EXAMPLE_EXPERTS, EXAMPLE_VOCAB,
EXAMPLE_SEQ, EXAMPLE_BATCH.
"""
import os

import torch
from torch.distributed.fsdp import fully_shard
from transformers import MixtralConfig, MixtralForCausalLM

NUM_MICRO_BATCHES = 2


def _size(name: str, default: int) -> int:
    return int(os.environ.get(f"EXAMPLE_{name}", default))


def build(ctx):
    """(model, make_batch, step) on ctx.device, every decoder layer and the root sharded."""
    dim, vocab = _size("DIM", 64), _size("VOCAB", 512)
    seq, batch = _size("SEQ", 32), _size("BATCH", 2)
    config = MixtralConfig(vocab_size=vocab, hidden_size=dim, intermediate_size=dim * 2,
                           num_hidden_layers=_size("LAYERS", 2),
                           num_attention_heads=_size("HEADS", 4), num_key_value_heads=2,
                           num_local_experts=_size("EXPERTS", 4), num_experts_per_tok=2,
                           max_position_embeddings=seq, attn_implementation="sdpa",
                           experts_implementation="batched_mm")
    torch.manual_seed(0)
    with torch.device(ctx.device):
        model = MixtralForCausalLM(config)
    for layer in model.model.layers:
        fully_shard(layer, mesh=ctx.mesh)
    fully_shard(model, mesh=ctx.mesh)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)

    def make_batch():
        return tuple(torch.randint(0, vocab, (batch, seq), device=ctx.device)
                     for _ in range(NUM_MICRO_BATCHES))

    def step(batch):
        for i, ids in enumerate(batch):
            model.set_requires_gradient_sync(i == len(batch) - 1)
            (model(input_ids=ids, labels=ids).loss / len(batch)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return model, make_batch, step
