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

from actors.capture.workloads.models.llama.model import GQAttention


class ChunkedAttention(GQAttention):
    """Grouped-query attention with rotary embeddings and chunked causal attention, or (a
    NoPE block: ``use_rope`` false) neither. The decoder sets both per block."""

    use_rope = True
    chunk = 0  # tokens per attention chunk; 0 = the whole sequence

    def attend(self, q, k, v, cos, sin):
        if not self.use_rope:
            return super().attend(q, k, v, None, None)
        b, t = q.shape[:2]
        if self.chunk and t > self.chunk:  # (b * chunks, chunk, heads, head_dim): views
            q, k, v = (z.reshape(b * t // self.chunk, self.chunk, *z.shape[2:])
                       for z in (q, k, v))
            cos, sin = cos[:self.chunk], sin[:self.chunk]  # positions from each chunk's start
        return super().attend(q, k, v, cos, sin)
