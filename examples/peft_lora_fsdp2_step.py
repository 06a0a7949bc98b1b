"""A user's LoRA fine-tuning step: transformers ``LlamaForCausalLM`` wrapped by PEFT's
``get_peft_model`` (LoRA adapters on the attention and MLP projections, the base model frozen),
every decoder layer and the root sharded with FSDP2 in bf16 mixed precision, AdamW over the
adapters only.

    tracefleet-capture workload=custom workload.entrypoint=examples/peft_lora_fsdp2_step.py:build \\
        world_size=2
    tracefleet-predict workload=custom workload.entrypoint=examples/peft_lora_fsdp2_step.py:build \\
        world_size=64

Frozen weights get no gradient and no optimizer state: what a LoRA job saves over full
fine-tuning, and what the prediction must not charge. Sizes come from the environment (tiny by
default): EXAMPLE_DIM, EXAMPLE_LAYERS, EXAMPLE_HEADS, EXAMPLE_KV_HEADS, EXAMPLE_VOCAB,
EXAMPLE_SEQ, EXAMPLE_BATCH, EXAMPLE_LORA_RANK.
"""
import os

import torch
from peft import LoraConfig, get_peft_model
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from transformers import LlamaConfig, LlamaForCausalLM


def _size(name: str, default: int) -> int:
    return int(os.environ.get(f"EXAMPLE_{name}", default))


def build(ctx):
    """(model, make_batch, step) on ctx.device: LoRA adapters over a frozen, sharded Llama."""
    dim, vocab = _size("DIM", 64), _size("VOCAB", 512)
    seq, batch = _size("SEQ", 32), _size("BATCH", 2)
    config = LlamaConfig(vocab_size=vocab, hidden_size=dim, intermediate_size=dim * 8 // 3,
                         num_hidden_layers=_size("LAYERS", 2),
                         num_attention_heads=_size("HEADS", 4),
                         num_key_value_heads=_size("KV_HEADS", 2), max_position_embeddings=seq,
                         tie_word_embeddings=False, attn_implementation="sdpa")
    torch.manual_seed(0)  # the same base weights and adapters on every rank
    base = LlamaForCausalLM(config).to(ctx.device)
    lora = LoraConfig(r=_size("LORA_RANK", 8), lora_alpha=16, lora_dropout=0.05,
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                      "gate_proj", "up_proj", "down_proj"],
                      task_type="CAUSAL_LM")
    model = get_peft_model(base, lora)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.base_model.model.model.layers:
        fully_shard(layer, mesh=ctx.mesh, mp_policy=policy)
    fully_shard(model, mesh=ctx.mesh, mp_policy=policy)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=2e-4, weight_decay=0.0)

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
