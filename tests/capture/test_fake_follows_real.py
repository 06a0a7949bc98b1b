"""The fake capture takes the path the real run takes, and loses nothing (issue 20, items 1-2):

* a forward that raises (checkpoint's default early stop, a try/except around a module) still
  closes its module ranges, so no op of the step is lost;
* small integral tensors carry their values on fake, so data-dependent branches run as on a
  real device, and libraries that ask whether a tensor is fake hear "no" for them;
* the run's own frees are written into the fake trace and the faithful replay holds what the
  user's code held (a returned output kept through backward).

Real and fake captures are compared with tests/support/fake_vs_real.py (in-process, world 1).
"""
from __future__ import annotations

import gzip

import orjson
import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from actors.capture.fake.fake_mode import CaptureFakeMode
from actors.capture.fake.fake_values import known_values_look_real, value_of
from actors.capture.fake.meta_storage import unique_meta_storages
from actors.replay.config import AllocationConfig, ReplayConfig
from actors.replay.engine import ReplayEngine
from actors.trace import load_trace
from actors.trace.conventions import FREED_OP
from tests.support.fake_vs_real import as_entrypoint, capture_fake, capture_real, \
    compare_fake_to_real

DIM = 32


class Raising(nn.Module):
    """A block whose sub-module raises inside its forward, caught by the block."""

    def __init__(self):
        super().__init__()
        self.inner, self.out = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)

    def forward(self, x):
        try:
            self.inner(x, "an argument nn.Linear does not take")
        except TypeError:
            pass
        return self.out(torch.relu(self.inner(x)))


class Checkpointed(nn.Module):
    """Blocks under torch.utils.checkpoint with its defaults (non-reentrant, early stop)."""

    def __init__(self, blocks):
        super().__init__()
        self.blocks = blocks

    def forward(self, x):
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return x


def _mlp():
    return nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))


def _step(make_model, branch=None):
    """A build(ctx): AdamW on the model; ``branch(x)`` may steer the loss on a value."""
    def build(ctx):
        torch.manual_seed(0)
        model = make_model().to(ctx.device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def make_batch():
            return torch.randn(8, DIM, device=ctx.device), \
                torch.ones(8, dtype=torch.long, device=ctx.device)

        def step(batch):
            x, mask = batch
            out = model(x)
            loss = out.pow(2).mean() if branch is None else branch(out, mask)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        return model, make_batch, step
    return build


def _module_ranges(path) -> tuple[int, int]:
    """(module range nodes, nodes whose parent was never written) of a trace file."""
    with gzip.open(path) as f:
        nodes = orjson.loads(f.read())["nodes"]
    ids = {n["id"] for n in nodes}
    return (sum(n["name"].startswith("## module:") for n in nodes),
            sum(n["ctrl_deps"] not in ids for n in nodes))


@pytest.mark.parametrize("name, make_model", [
    ("early_stop", lambda: Checkpointed(nn.ModuleList(_mlp() for _ in range(3)))),
    ("try_except", lambda: nn.Sequential(Raising(), Raising())),
])
def test_a_forward_that_raises_loses_no_op(name, make_model, tmp_path):
    """The recompute's early stop and a caught exception both raise inside a module's forward;
    its range closes anyway, so every op of the step is in the trace, as on cpu."""
    real, fake = compare_fake_to_real(as_entrypoint(_step(make_model), f"raising_{name}"),
                                      tmp_path)
    for trace in (real, fake):
        assert trace.meta["num_dropped_ops"] == 0
        assert sum(op.name == "aten::linear" for op in trace.ops) >= 4
    assert _module_ranges(tmp_path / "fake" / "rank-0.et.json.gz")[0] > 0


def test_data_dependent_branch_takes_the_real_path(tmp_path):
    """``if mask.all()`` on a tensor the step made from known data runs on fake with the real
    answer (the branch's extra op is there on both sides), where fake tensors used to raise."""
    def branch(out, mask):
        if (mask == 1).all():
            return out.pow(2).mean() + out.abs().mean()
        return out.pow(2).mean()

    real, fake = compare_fake_to_real(as_entrypoint(_step(_mlp, branch), "branch"), tmp_path)
    assert sum(op.name == "aten::abs" for op in fake.ops) == 1


def test_known_values_are_integral_and_hidden_from_fakeness_predicates():
    """Known values follow integer data (ids, positions, masks), not floats (no model math
    runs for real); a library's "is this fake?" predicate says no exactly for them."""
    transformers = pytest.importorskip("transformers.utils.import_utils")
    with unique_meta_storages(), CaptureFakeMode():
        positions = torch.arange(6).unsqueeze(0)
        mask = (torch.diff(positions, dim=-1) != 1).cumsum(-1)
        weights = torch.randn(6)
        assert value_of(mask) is not None and value_of(weights) is None
        assert bool((mask == 0).all()) and int(positions.max()) == 5
        with known_values_look_real():
            assert not transformers.is_fake_tensor(mask)
            assert transformers.is_fake_tensor(weights)
        assert transformers.is_fake_tensor(mask)  # restored after the block
        mask[0, 0] = weights[0].long()  # written from unknown data: the value is forgotten
        with pytest.raises(Exception):
            bool((mask == 0).all())


def test_integer_constants_have_their_values():
    """``torch.tensor(data)`` of integers is known (split sizes made from counts read back
    with ``tolist()``); of floats it is not."""
    with unique_meta_storages(), CaptureFakeMode():
        counts = torch.tensor([3, 4, 5, 6])
        assert counts.view(2, 2).sum(1).tolist() == [7, 11]
        assert value_of(torch.tensor([1.5, 2.5])) is None


def test_a_functional_wait_returns_its_input_storage():
    """Eagerly ``wait_tensor`` returns the collective's own result; on fake too, so a trace
    does not hold the result twice."""
    with unique_meta_storages(), CaptureFakeMode():
        result = torch.empty(4, 4)
        waited = torch.ops._c10d_functional.wait_tensor(result)
        assert waited.untyped_storage()._cdata == result.untyped_storage()._cdata


class Kept(nn.Module):
    """Returns its hidden activation beside the output; the step keeps both until backward."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(DIM, 16 * DIM), nn.Linear(16 * DIM, DIM)

    def forward(self, x):
        hidden = torch.relu(self.up(x))
        return self.down(hidden), hidden * 2


def _kept_step(ctx):
    torch.manual_seed(0)
    model = Kept().to(ctx.device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step(batch):
        out = model(batch[0])  # the tuple, and so the doubled hidden, lives through backward
        out[0].pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return model, lambda: (torch.randn(64, DIM, device=ctx.device),), step


def _faithful_peak(trace) -> int:
    engine = ReplayEngine(trace, ReplayConfig(
        mode="compute", device="meta", iters=1, warmup_iters=1, measure_memory=False,
        allocation=AllocationConfig(mode="faithful")))
    try:
        return engine.run().to_dict()["accounted_peak_bytes"]
    finally:
        engine.close()


def test_recorded_frees_hold_what_the_step_kept(tmp_path):
    """The doubled hidden activation is last used in forward but freed only when the step
    returns: the fake trace records that free, and its replay holds the storage through
    backward; the real trace, which cannot tell, frees it at its last use."""
    spec = as_entrypoint(_kept_step, "kept")
    fake = load_trace(capture_fake(spec, tmp_path / "fake"))
    real = load_trace(capture_real(spec, tmp_path / "real"))
    with gzip.open(tmp_path / "fake" / "rank-0.et.json.gz") as f:
        assert any(n["name"] == FREED_OP for n in orjson.loads(f.read())["nodes"])
    assert fake.recorded_frees and fake.meta["num_recorded_frees"] == len(fake.recorded_frees)
    # held through backward at its peak: the doubled hidden and the output (both in the
    # tuple), and a few scalars the step's locals keep
    kept_bytes = 64 * 16 * DIM * 4 + 64 * DIM * 4
    assert kept_bytes <= _faithful_peak(fake) - _faithful_peak(real) <= kept_bytes + 64


def _temporary_step(ctx):
    """``(h.detach() + neg(h)) * 0.5``: ``neg``'s output (which autograd does not save) is let go of
    as the ``add`` returns, before the ``mul`` runs, as loss parallel's backward lets go of
    ``exp(x)`` in ``(grad_input + exp(x)) * grad_output``."""
    torch.manual_seed(0)
    model = nn.Linear(DIM, 64 * DIM).to(ctx.device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step(batch):
        h = model(batch[0])
        ((h.detach() + torch.neg(h)) * 0.5).mean().backward()  # one gradient path
        opt.step()
        opt.zero_grad(set_to_none=True)

    return model, lambda: (torch.randn(256, DIM, device=ctx.device),), step


def test_a_free_written_as_an_op_begins_is_before_it(tmp_path):
    """The fake mode writes the run's frees as an op's dispatch begins, after the observer
    opened that op's node; read as frees after it, ``neg``'s output was held through ``mul``
    (one activation too many at the forward's peak). Fake and real peak alike, but for the
    scalars the step's locals keep (test_recorded_frees_hold_what_the_step_kept)."""
    spec = as_entrypoint(_temporary_step, "temporary")
    fake = load_trace(capture_fake(spec, tmp_path / "fake"))
    real = load_trace(capture_real(spec, tmp_path / "real"))
    neg = next(op.index for op in fake.ops if op.name == "aten::neg")
    neg_out = fake.ops[neg].outputs[0].suid
    assert [end for suid, end, _ in fake.recorded_frees if suid == neg_out] == [neg + 1]  # add
    assert 0 <= _faithful_peak(fake) - _faithful_peak(real) <= 64
