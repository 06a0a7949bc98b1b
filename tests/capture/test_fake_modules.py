"""torch.nn modules on workload.device=fake: each small step below is captured on fake and for
real on cpu (tests/support/fake_vs_real.py) and both traces hold the same top-level ops. The
models are built the everyday way, ``Model().to(ctx.device)``, and nn.TransformerEncoder /
Decoder deep-copy their layer (the deepcopy that used to fail on fake)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from actors.capture.fake.fake_mode import CaptureFakeMode
from actors.capture.fake.meta_storage import unique_meta_storages
from actors.errors import ConfigError
from tests.support.fake_vs_real import (as_entrypoint, capture_fake, compare_fake_to_real,
                                        known_difference)

DIM, HEADS, FFN, SEQ, BATCH = 16, 2, 32, 5, 2


def module_step(make_model, make_inputs, loss=None):
    """A build(ctx): ``make_model().to(ctx.device)``, AdamW; the step's loss is ``loss(output,
    inputs)`` (default: the mean square of the first output)."""
    def build(ctx):
        torch.manual_seed(0)
        model = make_model().to(ctx.device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def step(inputs):
            out = model(*inputs)
            out = out[0] if isinstance(out, tuple) else out
            (loss(out, inputs) if loss else out.float().pow(2).mean()).backward()
            opt.step()
            opt.zero_grad()

        return model, lambda: make_inputs(ctx.device), step
    return build


def randn(*shape):
    return lambda device: (torch.randn(*shape, device=device),)


class EncoderLM(nn.Module):
    """The issue's model: an embedding, nn.TransformerEncoderLayer blocks, a head; a causal
    mask, with the ``is_causal`` hint or (``hint=False``) left to the encoder to detect."""

    def __init__(self, vocab=32, hint=True):
        super().__init__()
        self.hint = hint
        self.emb = nn.Embedding(vocab, DIM)
        layer = nn.TransformerEncoderLayer(DIM, HEADS, FFN, dropout=0.1, batch_first=True)
        self.blocks = nn.TransformerEncoder(layer, 2)
        self.head = nn.Linear(DIM, vocab)

    def forward(self, idx):
        mask = nn.Transformer.generate_square_subsequent_mask(idx.shape[1], device=idx.device)
        return self.head(self.blocks(self.emb(idx), mask=mask, is_causal=self.hint or None))


class Embeddings(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.bag = nn.Embedding(20, 8, padding_idx=0), nn.EmbeddingBag(20, 8)

    def forward(self, idx):
        return self.emb(idx).sum(1) + self.bag(idx)


def lm_loss(logits, inputs):
    return F.cross_entropy(logits.flatten(0, 1), inputs[0].flatten())


def mha_masked(batch_first):
    """MultiheadAttention with a causal attn_mask and a key_padding_mask."""
    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(DIM, HEADS, batch_first=batch_first)

        def forward(self, x):
            s = x.shape[1] if batch_first else x.shape[0]
            causal = nn.Transformer.generate_square_subsequent_mask(s, device=x.device)
            padding = torch.zeros(BATCH, s, dtype=torch.bool, device=x.device)
            return self.attn(x, x, x, attn_mask=causal, key_padding_mask=padding)[0]
    return Attn


STEPS = {
    "encoder_lm": module_step(EncoderLM, lambda d: (torch.randint(0, 32, (BATCH, SEQ), device=d),),
                              lm_loss),
    "encoder_lm_mask_detected": module_step(lambda: EncoderLM(hint=False), lambda d: (
        torch.randint(0, 32, (BATCH, SEQ), device=d),), lm_loss),
    "mha_seq_first": module_step(lambda: nn.MultiheadAttention(DIM, HEADS),
                                 lambda d: (torch.randn(SEQ, BATCH, DIM, device=d),) * 3),
    "mha_batch_first_masks": module_step(mha_masked(True), randn(BATCH, SEQ, DIM)),
    "mha_seq_first_masks": module_step(mha_masked(False), randn(SEQ, BATCH, DIM)),
    "decoder_batch_first_norm_first": module_step(
        lambda: nn.TransformerDecoder(nn.TransformerDecoderLayer(
            DIM, HEADS, FFN, batch_first=True, norm_first=True), 2),
        lambda d: (torch.randn(BATCH, SEQ, DIM, device=d), torch.randn(BATCH, 7, DIM, device=d))),
    "transformer_seq_first_masks": module_step(
        lambda: nn.Transformer(DIM, HEADS, 1, 1, FFN),
        lambda d: (torch.randn(7, BATCH, DIM, device=d), torch.randn(SEQ, BATCH, DIM, device=d),
                   None, nn.Transformer.generate_square_subsequent_mask(SEQ, device=d))),
    "lstm_batch_first": module_step(lambda: nn.LSTM(8, DIM, 2, batch_first=True),
                                    randn(BATCH, SEQ, 8)),
    "lstm_bidirectional_proj": module_step(lambda: nn.LSTM(8, DIM, bidirectional=True,
                                                           proj_size=4), randn(SEQ, BATCH, 8)),
    "gru_dropout": module_step(lambda: nn.GRU(8, DIM, 2, dropout=0.1), randn(SEQ, BATCH, 8)),
    "rnn_cells": module_step(lambda: nn.Sequential(nn.RNNCell(8, DIM), nn.Linear(DIM, DIM)),
                             randn(BATCH, 8)),
    "cnn": module_step(lambda: nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 8, 3, groups=2), nn.GroupNorm(2, 8), nn.SiLU(), nn.AdaptiveAvgPool2d(1),
        nn.Flatten(), nn.Dropout(0.1), nn.Linear(8, 4)), randn(BATCH, 3, 8, 8)),
    "conv3d_transpose_instancenorm": module_step(lambda: nn.Sequential(
        nn.Conv3d(2, 4, 3, padding=1), nn.InstanceNorm3d(4, affine=True),
        nn.ConvTranspose3d(4, 2, 2, stride=2), nn.AvgPool3d(2)), randn(1, 2, 4, 4, 4)),
    "conv1d_batchnorm1d": module_step(lambda: nn.Sequential(
        nn.Conv1d(4, 8, 3, dilation=2), nn.BatchNorm1d(8), nn.ConvTranspose1d(8, 4, 3)),
        randn(BATCH, 4, 6)),
    "upsample_pixelshuffle_pad": module_step(lambda: nn.Sequential(
        nn.Conv2d(4, 8, 1), nn.PixelShuffle(2), nn.Upsample(scale_factor=2, mode="bilinear"),
        nn.ReflectionPad2d(1), nn.Conv2d(2, 2, 3), nn.Unfold(2)), randn(1, 4, 4, 4)),
    "embeddings": module_step(Embeddings, lambda d: (torch.randint(0, 20, (3, 4), device=d),)),
    "activations_norms": module_step(lambda: nn.Sequential(
        nn.Linear(8, 8), nn.Mish(), nn.Hardswish(), nn.PReLU(), nn.ELU(), nn.Softplus(),
        nn.GLU(), nn.RMSNorm(4), nn.LayerNorm(4), nn.Tanh(), nn.LogSoftmax(-1)), randn(3, 8)),
    "bilinear": module_step(lambda: nn.Bilinear(4, 5, 3),
                            lambda d: (torch.randn(2, 4, device=d), torch.randn(2, 5, device=d))),
    "parametrized_weight_and_spectral_norm": module_step(lambda: nn.Sequential(
        nn.utils.parametrizations.weight_norm(nn.Linear(8, 8)),
        nn.utils.parametrizations.spectral_norm(nn.Linear(8, 8))), randn(BATCH, 8)),
    "sdpa_causal": module_step(lambda: nn.Linear(8, 8), randn(BATCH, HEADS, SEQ, 8),
                               lambda o, _: F.scaled_dot_product_attention(o, o, o,
                                                                           is_causal=True).sum()),
    "losses": module_step(lambda: nn.Linear(8, 5), randn(4, 8), lambda o, _: (
        F.cross_entropy(o, torch.zeros(4, dtype=torch.long, device=o.device), label_smoothing=0.1)
        + F.mse_loss(o, torch.zeros_like(o)) + F.smooth_l1_loss(o, torch.ones_like(o))
        + F.huber_loss(o, torch.ones_like(o)) + F.l1_loss(o, torch.ones_like(o))
        + F.binary_cross_entropy(o.sigmoid(), torch.ones_like(o))
        + F.kl_div(o.log_softmax(-1), torch.full_like(o, 0.2), reduction="batchmean")
        + F.nll_loss(o.log_softmax(-1), torch.ones(4, dtype=torch.long, device=o.device),
                     ignore_index=0)
        + F.multi_margin_loss(o, torch.ones(4, dtype=torch.long, device=o.device)))),
}


@pytest.mark.parametrize("name", sorted(STEPS))
def test_module_step_on_fake_records_the_real_ops(name, tmp_path):
    real, fake = compare_fake_to_real(as_entrypoint(STEPS[name], f"nn_{name}"), tmp_path)
    assert len(fake.ops) > 20 and [s.name for s in fake.steps] == ["ProfilerStep#1"]


def test_bce_with_logits_backward_runs_out_of_place_on_fake(tmp_path):
    """The one module difference found: torch writes binary_cross_entropy_with_logits's
    backward out of place when a tensor is subclass-like, which every tensor is under a
    dispatch mode, so fake records ``sub`` + ``mul`` where cpu records ``sub_`` + ``mul_``:
    one temporary of the logits' size more, for an instant."""
    build = module_step(lambda: nn.Linear(8, 5), randn(4, 8),
                        lambda o, _: F.binary_cross_entropy_with_logits(o, torch.ones_like(o)))
    assert known_difference(as_entrypoint(build, "nn_bce_with_logits"), tmp_path) == (
        "aten::mul: real 0, fake 1; aten::mul_: real 5, fake 4; "
        "aten::sub: real 0, fake 1; aten::sub_: real 1, fake 0")


def test_deep_copied_fake_modules_stay_in_the_capture_mode():
    """copy.deepcopy (nn.TransformerEncoder's layer clones, an EMA model) keeps fake tensors in
    the capture's mode, so the copies move with .to() and compute with the originals."""
    with unique_meta_storages(), CaptureFakeMode() as mode:
        encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(DIM, HEADS, FFN), 2)
        ema = copy.deepcopy(encoder).to(torch.device("cpu")).to(torch.bfloat16)
        assert copy.deepcopy(mode) is mode
        assert {p.fake_mode for p in ema.parameters()} == {mode}
        assert {p.dtype for p in ema.parameters()} == {torch.bfloat16}
        assert len({p.untyped_storage().data_ptr() for p in ema.parameters()}) == \
            len(list(ema.parameters()))  # copies are storages of their own
        out = encoder.to(torch.device("cpu"))(torch.randn(SEQ, BATCH, DIM))
        assert out.shape == (SEQ, BATCH, DIM)


def test_a_mask_fake_cannot_tell_causal_is_refused_with_the_hint_to_pass(tmp_path):
    """A hand-made mask and no is_causal hint: nn.TransformerEncoder would read the mask's values
    to decide; on fake that is refused, naming the hint."""
    def make_inputs(device):
        x = torch.randn(BATCH, SEQ, DIM, device=device)
        return x, torch.triu(torch.full((SEQ, SEQ), float("-inf"), device=device), diagonal=1)

    build = module_step(lambda: nn.TransformerEncoder(nn.TransformerEncoderLayer(
        DIM, HEADS, FFN, batch_first=True), 1), make_inputs)
    spec = as_entrypoint(build, "nn_encoder_own_mask")
    with pytest.raises(ConfigError, match=r"nn.Transformer\* got a 5x5 attention mask and no "
                                          r"is_causal hint.*pass is_causal=True or False"):
        capture_fake(spec, tmp_path)
