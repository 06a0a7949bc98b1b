"""Llama 4's attention (iRoPE), as Meta's reference model and torchtitan's llama4 compute it:
grouped-query attention whose rotary blocks attend within fixed chunks of the sequence
(``chunk`` tokens: a query sees the earlier tokens of its own chunk only) and whose every
``nope_every``-th block has no rotary embedding and attends to the whole causal sequence.

torchtitan runs the chunks as one FlexAttention call with a block mask; here each chunk is a
sample of one causal attention call (the chunks laid along the batch), which keeps what
flash attention keeps per token and builds no mask. At ``seq_len <= chunk`` (the public
training runs: 8192 and 8192) both are plain causal attention. The rest of a Llama 4 block and
decoder is Llama's (actors/capture/workloads/models/llama/model.py) with MoE blocks
interleaved (``moe_every``)."""
from __future__ import annotations

from actors.capture.workloads.attention import causal_attention
from actors.capture.workloads.models.llama.model import GQAttention, repeat_kv, apply_rotary


class ChunkedAttention(GQAttention):
    """Grouped-query attention with rotary embeddings and chunked causal attention, or (a
    NoPE block: ``use_rope`` false) neither. The decoder sets both per block."""

    use_rope = True
    chunk = 0  # tokens per attention chunk; 0 = the whole sequence

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        q, k, v = self.project(x)  # (b, t, heads, head_dim)
        n_rep = self.n_heads // self.n_kv_heads
        chunk = self.chunk if self.use_rope and self.chunk and t > self.chunk else t
        if chunk < t:  # (b * chunks, chunk, heads, head_dim): views, the chunks as samples
            q, k, v = (z.reshape(b * t // chunk, chunk, *z.shape[2:]) for z in (q, k, v))
            cos, sin = cos[:chunk], sin[:chunk]  # positions count from each chunk's start
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        if self.use_rope:
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        y = causal_attention(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep), self.attention)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))
