"""Every torch.optim optimizer on workload.device=fake: each with foreach=False and True, and
fused=True where it has a fused kernel on cpu, captured on fake and for real on cpu with the same
top-level ops (tests/support/fake_vs_real.py); the optimizers whose step reads tensor values
are refused naming the line."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from actors.errors import ConfigError
from tests.support.fake_vs_real import as_entrypoint, capture_fake, compare_fake_to_real

O = torch.optim
# optimizer -> constructor arguments beyond lr (momentum for SGD: its buffers are the state)
FOREACH = {O.SGD: {"momentum": 0.9}, O.Adam: {}, O.AdamW: {}, O.Adagrad: {}, O.RMSprop: {},
           O.Adadelta: {}, O.Adamax: {}, O.NAdam: {}, O.RAdam: {}, O.Rprop: {}}
FUSED_ON_CPU = (O.SGD, O.Adam, O.AdamW, O.Adagrad)  # the optimizers with a cpu fused kernel
VARIANTS = [(cls, {**kw, "foreach": f}) for cls, kw in FOREACH.items() for f in (False, True)]
VARIANTS += [(cls, {**FOREACH[cls], "fused": True}) for cls in FUSED_ON_CPU]
VARIANTS += [(O.SGD, {"momentum": 0.9, "nesterov": True, "weight_decay": 0.1}),
             (O.Adam, {"amsgrad": True, "foreach": True}),
             (O.AdamW, {"amsgrad": True, "fused": True}),
             (O.NAdam, {"decoupled_weight_decay": True, "weight_decay": 0.1}),
             (O.RAdam, {"decoupled_weight_decay": True, "weight_decay": 0.1, "foreach": True}),
             (O.RMSprop, {"momentum": 0.9, "centered": True})]


def optimizer_step(make_optimizer, model_factory=None, closure=False):
    """A build(ctx): a two-Linear MLP (or ``model_factory()``), the optimizer
    ``make_optimizer(params)``; one step of a mean-square loss (passed as a closure too when
    ``closure``)."""
    def build(ctx):
        torch.manual_seed(0)
        model = (model_factory or (lambda: nn.Sequential(
            nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))))().to(ctx.device)
        opt = make_optimizer(model.parameters())

        def step(batch):
            def loss_fn():
                opt.zero_grad()
                loss = model(batch[0]).pow(2).mean()
                loss.backward()
                return loss

            if closure:
                opt.step(loss_fn)
            else:
                loss_fn()
                opt.step()
            opt.zero_grad()

        return model, lambda: (torch.randn(4, 16, device=ctx.device),), step
    return build


def _name(cls, kw) -> str:
    return "_".join([cls.__name__] + [f"{k}_{v}" for k, v in kw.items()])


@pytest.mark.parametrize("cls, kw", VARIANTS, ids=[_name(c, k) for c, k in VARIANTS])
def test_optimizer_step_on_fake_records_the_real_ops(cls, kw, tmp_path):
    build = optimizer_step(lambda params: cls(params, lr=1e-2, **kw))
    real, fake = compare_fake_to_real(as_entrypoint(build, f"optim_{_name(cls, kw)}"), tmp_path)
    if kw.get("foreach"):  # the multi-tensor kernels ran, not one op per parameter
        assert any(op.name.startswith("aten::_foreach_") for op in fake.ops)
    if kw.get("fused"):
        assert any(op.name.startswith("aten::_fused_") for op in fake.ops)


def test_muon_on_fake_records_the_real_ops(tmp_path):
    """Muon takes 2-D parameters only: a bias-free MLP."""
    build = optimizer_step(lambda params: O.Muon(params, lr=1e-2),
                           lambda: nn.Sequential(nn.Linear(16, 16, bias=False), nn.ReLU(),
                                                 nn.Linear(16, 4, bias=False)))
    compare_fake_to_real(as_entrypoint(build, "optim_Muon"), tmp_path)


@pytest.mark.parametrize("cls, kw, line", [
    (O.LBFGS, {}, r"torch/optim/lbfgs.py:\d+ in step: `loss = float\(orig_loss\)`"),
    (O.ASGD, {"foreach": False}, r"torch/optim/asgd.py:\d+ in _single_tensor_asgd: "
                                 r"`if capturable or mu.item\(\) != 1:`"),
    (O.ASGD, {"foreach": True}, r"torch/optim/optimizer.py:\d+ in _get_value: .*"
                                r"in torch/optim/asgd.py:\d+"),
    (O.Adafactor, {}, r"torch/optim/_adafactor.py:\d+ in _single_tensor_adafactor: "
                      r"`alpha = max\(eps2, param.norm\(2\).item\(\)"),
], ids=["LBFGS", "ASGD", "ASGD_foreach", "Adafactor"])
def test_optimizers_reading_values_are_refused_naming_the_line(cls, kw, line, tmp_path):
    """LBFGS (its loss and its convergence tests), ASGD (its mu and step count: factory-made,
    so fake does not track them) and Adafactor (a parameter's norm) read tensor values in their
    step; fake tensors have none."""
    build = optimizer_step(lambda params: cls(params, lr=1e-2, **kw), closure=cls is O.LBFGS)
    spec = as_entrypoint(build, f"optim_refused_{_name(cls, kw)}")
    with pytest.raises(ConfigError, match="workload.device=fake: the step reads a tensor's value "
                                          r"\(aten._local_scalar_dense.default.*at " + line
                                          + r".*called from .*test_fake_optim.py:\d+ in step"):
        capture_fake(spec, tmp_path)
