"""Everyday training idioms on workload.device=fake (actors/capture/fake/fake_idioms.py): autocast,
GradScaler, gradient clipping, LR schedulers, accumulation, checkpointing, EMA / SWA copies,
each captured on fake and for real on cpu with the same top-level ops
(tests/support/fake_vs_real.py); and what fake cannot run, refused naming what and where."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.optim import lr_scheduler as sched
from torch.optim.swa_utils import SWALR, AveragedModel, get_ema_multi_avg_fn
from torch.utils.checkpoint import checkpoint

from actors.errors import ConfigError
from tests.support.fake_vs_real import as_entrypoint, capture_fake, compare_fake_to_real


def mlp():
    return nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 4))


def idiom_step(autocast=None, scaler=False, unscale=False, clip=None, scheduler=None,
               num_micro=1, ckpt=None, average=None, loss=None, model=mlp,
               optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3)):
    """A build(ctx) of an MLP step with the idioms asked for: ``autocast`` (a dtype),
    GradScaler (``scaler``; ``unscale``: an explicit ``unscale_`` before clipping), ``clip``
    (``fn(params)``), ``scheduler`` (``fn(opt)``), ``num_micro`` accumulated micro-batches,
    ``ckpt`` (checkpoint's ``use_reentrant``), ``average`` (``fn(model)``: an AveragedModel
    updated after the step), ``loss`` (``fn(output)``)."""
    def build(ctx):
        torch.manual_seed(0)
        net = model().to(ctx.device)
        opt = optimizer(net.parameters())
        lrs = scheduler(opt) if scheduler else None
        grad_scaler = torch.amp.GradScaler("cpu") if scaler else None
        averaged = average(net) if average else None

        def step(batch):
            for x in batch:
                with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
                    out = checkpoint(net, x.requires_grad_(bool(ckpt)), use_reentrant=ckpt) \
                        if ckpt is not None else net(x)
                    value = (loss or (lambda o: o.float().pow(2).mean()))(out) / num_micro
                (grad_scaler.scale(value) if grad_scaler else value).backward()
            if grad_scaler and unscale:
                grad_scaler.unscale_(opt)
            if clip:
                clip(net.parameters())
            if grad_scaler:
                grad_scaler.step(opt)
                grad_scaler.update()
            else:
                opt.step()
            if lrs:
                lrs.step()
            opt.zero_grad(set_to_none=num_micro == 1)
            if averaged is not None:
                averaged.update_parameters(net)

        return net, lambda: tuple(torch.randn(4, 16, device=ctx.device)
                                  for _ in range(num_micro)), step
    return build


def warmup_cosine(opt):
    return sched.SequentialLR(opt, [sched.LinearLR(opt, 0.1, total_iters=2),
                                    sched.CosineAnnealingLR(opt, 10)], milestones=[2])


def clip_norm(**kw):
    return lambda params: torch.nn.utils.clip_grad_norm_(params, 1.0, **kw)


def bn_mlp():  # BatchNorm: AveragedModel copies its buffers (num_batches_tracked: a constant)
    return nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.Linear(16, 4))


IDIOMS = {
    "autocast_bf16": idiom_step(autocast=torch.bfloat16),
    "autocast_fp16_grad_scaler": idiom_step(autocast=torch.float16, scaler=True),
    "grad_scaler_unscale_clip": idiom_step(autocast=torch.float16, scaler=True, unscale=True,
                                           clip=clip_norm()),
    "grad_scaler_fused_adamw": idiom_step(autocast=torch.float16, scaler=True, optimizer=lambda p:
                                          torch.optim.AdamW(p, lr=1e-3, fused=True)),
    "clip_grad_norm": idiom_step(clip=clip_norm()),
    "clip_grad_norm_foreach": idiom_step(clip=clip_norm(foreach=True)),
    "clip_grad_norm_per_tensor": idiom_step(clip=clip_norm(foreach=False)),
    "clip_grad_norm_inf": idiom_step(clip=clip_norm(norm_type=float("inf"))),
    "clip_grad_value": idiom_step(clip=lambda p: torch.nn.utils.clip_grad_value_(p, 0.5)),
    "step_lr": idiom_step(scheduler=lambda o: sched.StepLR(o, 1, gamma=0.5)),
    "one_cycle_lr": idiom_step(scheduler=lambda o: sched.OneCycleLR(o, 0.1, total_steps=10)),
    "lambda_lr": idiom_step(scheduler=lambda o: sched.LambdaLR(o, lambda s: 0.9 ** s)),
    "warmup_then_cosine": idiom_step(scheduler=warmup_cosine),
    "grad_accumulation": idiom_step(num_micro=2, clip=clip_norm()),
    "checkpoint": idiom_step(ckpt=False),
    "checkpoint_reentrant": idiom_step(ckpt=True),
    "ema_averaged_model": idiom_step(model=bn_mlp, average=lambda m: AveragedModel(
        m, multi_avg_fn=get_ema_multi_avg_fn(0.99))),
    "swa_averaged_model_swalr": idiom_step(model=bn_mlp, average=AveragedModel,
                                           scheduler=lambda o: SWALR(o, swa_lr=0.05)),
    "cross_entropy_label_smoothing": idiom_step(loss=lambda o: F.cross_entropy(
        o.float(), torch.zeros(o.shape[0], dtype=torch.long, device=o.device),
        label_smoothing=0.1)),
}


@pytest.mark.parametrize("name", sorted(IDIOMS))
def test_idiom_on_fake_records_the_real_ops(name, tmp_path):
    real, fake = compare_fake_to_real(as_entrypoint(IDIOMS[name], f"idiom_{name}"), tmp_path)
    names = {op.name for op in fake.ops}
    if "grad_scaler" in name:  # the found-inf check ran and was read; the optimizer stepped
        assert "aten::_amp_foreach_non_finite_check_and_unscale_" in names
        assert "aten::_amp_update_scale_" in names
        assert names & {"aten::addcdiv_", "aten::_fused_adamw_"}
        if "fused" not in name:
            assert "aten::item" in names
    if name.startswith("clip_grad_norm") and "per_tensor" not in name:
        assert "aten::_foreach_norm" in names  # the cpu default is foreach, on fake too


class ValueReads(nn.Module):
    """A step that reads a value of its own, chosen by ``kind``."""

    def __init__(self, kind):
        super().__init__()
        self.kind, self.lin = kind, nn.Linear(16, 4)

    def forward(self, x):
        out = self.lin(x)
        if self.kind == "masked_select":
            return out[out > 0]
        if self.kind == "packed":
            packed = nn.utils.rnn.pack_padded_sequence(out.unsqueeze(1), [4], enforce_sorted=True)
            return packed.data
        return out


class SparseEmbedding(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 4, sparse=True)

    def forward(self, x):
        return self.emb(x.abs().long().clamp(max=19))


@pytest.mark.parametrize("kind, message", [
    ("item", r"reads a tensor's value \(aten._local_scalar_dense.default.*called from "
             r".*test_fake_idioms.py:\d+ in <lambda>: .*loss=lambda o: o.pow\(2\).mean\(\).item"),
    ("masked_select", r"an op whose output shape depends on tensor values "
                      r"\(aten.nonzero.default\).*test_fake_idioms.py:\d+ in forward: "
                      r"`return out\[out > 0\]`"),
    ("packed", r"output shape depends on tensor values \(aten._pack_padded_sequence.default\) "
               r"at torch/nn/utils/rnn.py:\d+ in pack_padded_sequence"),
    ("sparse", r"makes a sparse tensor \(aten._sparse_coo_tensor_with_dims_and_tensors.default.*"
               r"use dense gradients \(sparse=False\)"),
])
def test_what_fake_cannot_run_is_refused_naming_what_and_where(kind, message, tmp_path):
    if kind == "item":
        build = idiom_step(loss=lambda o: o.pow(2).mean().item() + o.pow(2).mean())
    elif kind == "sparse":
        build = idiom_step(model=SparseEmbedding, optimizer=lambda p:
                           torch.optim.SparseAdam(list(p), lr=1e-2))
    else:
        build = idiom_step(model=lambda: ValueReads(kind))
    with pytest.raises(ConfigError, match="workload.device=fake: .*" + message):
        capture_fake(as_entrypoint(build, f"refused_{kind}"), tmp_path)

