"""A user's Hugging Face step: transformers ``Qwen2ForCausalLM`` under FSDP2 in bf16 mixed
precision (bf16 all-gathers and compute, fp32 shards and gradient reduction), foreach AdamW
with weight decay.

    tracefleet-capture workload=custom workload.entrypoint=examples/hf_qwen2_fsdp2_bf16.py:build \\
        world_size=2
    tracefleet-predict workload=custom workload.entrypoint=examples/hf_qwen2_fsdp2_bf16.py:build \\
        world_size=64

Sizes come from the environment (tiny by default): EXAMPLE_DIM, EXAMPLE_LAYERS, EXAMPLE_HEADS,
EXAMPLE_KV_HEADS, EXAMPLE_VOCAB, EXAMPLE_SEQ, EXAMPLE_BATCH.
"""
import os

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from transformers import Qwen2Config, Qwen2ForCausalLM


def _size(name: str, default: int) -> int:
    return int(os.environ.get(f"EXAMPLE_{name}", default))


def build(ctx):
    """(model, make_batch, step) on ctx.device, every decoder layer and the root sharded."""
    dim, vocab = _size("DIM", 64), _size("VOCAB", 512)
    seq, batch = _size("SEQ", 32), _size("BATCH", 2)
    config = Qwen2Config(vocab_size=vocab, hidden_size=dim, intermediate_size=dim * 8 // 3,
                         num_hidden_layers=_size("LAYERS", 2),
                         num_attention_heads=_size("HEADS", 4),
                         num_key_value_heads=_size("KV_HEADS", 2), max_position_embeddings=seq,
                         tie_word_embeddings=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(ctx.device)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=ctx.mesh, mp_policy=policy)
    fully_shard(model, mesh=ctx.mesh, mp_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, foreach=True)

    def make_batch():
        ids = torch.randint(0, vocab, (batch, seq), device=ctx.device)
        return ids, torch.ones_like(ids)

    def step(batch):
        ids, attention_mask = batch
        loss = model(input_ids=ids, attention_mask=attention_mask, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return model, make_batch, step
