"""A user's Hugging Face step: transformers ``LlamaForCausalLM`` sharded with FSDP2, HF's own
gradient checkpointing (non-reentrant, torch's default early stop), AdamW.

    tracefleet-capture workload=custom \\
        workload.entrypoint=examples/hf_llama_fsdp2_checkpointing.py:build world_size=2
    tracefleet-predict workload=custom \\
        workload.entrypoint=examples/hf_llama_fsdp2_checkpointing.py:build world_size=64

The model computes its own loss from ``labels``, and the step keeps the returned
``CausalLMOutputWithPast`` (and with it the logits) until backward is done, as HF training
loops do. Sizes come from the environment (tiny by default): EXAMPLE_DIM, EXAMPLE_LAYERS,
EXAMPLE_HEADS, EXAMPLE_KV_HEADS, EXAMPLE_VOCAB, EXAMPLE_SEQ, EXAMPLE_BATCH.
"""
import os

import torch
from torch.distributed.fsdp import fully_shard
from transformers import LlamaConfig, LlamaForCausalLM


def _size(name: str, default: int) -> int:
    return int(os.environ.get(f"EXAMPLE_{name}", default))


def build(ctx):
    """(model, make_batch, step) on ctx.device, every decoder layer and the root sharded."""
    dim, vocab = _size("DIM", 64), _size("VOCAB", 512)
    seq, batch = _size("SEQ", 32), _size("BATCH", 2)
    config = LlamaConfig(vocab_size=vocab, hidden_size=dim, intermediate_size=dim * 8 // 3,
                         num_hidden_layers=_size("LAYERS", 2),
                         num_attention_heads=_size("HEADS", 4),
                         num_key_value_heads=_size("KV_HEADS", 2), max_position_embeddings=seq,
                         attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(ctx.device):
        model = LlamaForCausalLM(config)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for layer in model.model.layers:
        fully_shard(layer, mesh=ctx.mesh)
    fully_shard(model, mesh=ctx.mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def make_batch():
        return (torch.randint(0, vocab, (batch, seq), device=ctx.device),)

    def step(batch):
        (ids,) = batch
        outputs = model(input_ids=ids, labels=ids)
        outputs.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return model, make_batch, step
