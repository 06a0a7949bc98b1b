"""Backward markers for modules returning a dict or a Hugging Face ModelOutput
(actors/capture/backward_markers.py), on cpu and on fake; and a transformers Qwen2 step with a
foreach AdamW, whose fake trace holds the real ops and replays every one of them."""
from __future__ import annotations

import gzip
import warnings

import orjson
import pytest
import torch
import torch.nn as nn

from actors.trace.conventions import BWD_BEGIN, BWD_END, module_range_name
from tests.support.fake_vs_real import (as_entrypoint, capture_fake, capture_real,
                                        compare_fake_to_real)


def _markers(path) -> list[str]:
    """The trace's backward markers in execution (node id) order."""
    with gzip.open(path) as f:
        nodes = sorted(orjson.loads(f.read())["nodes"], key=lambda n: n["id"])
    return [n["name"] for n in nodes if n["name"].startswith("## module_bwd_")]


class DictBody(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(16, 16)

    def forward(self, x):
        return {"hidden": self.inner(x).relu(), "aux": [x.sum()]}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.pre, self.body, self.head = nn.Linear(16, 16), DictBody(), nn.Linear(16, 4)

    def forward(self, x):
        out = self.body(self.pre(x))
        return self.head(out["hidden"]) + out["aux"][0]


def net_step(ctx):
    torch.manual_seed(0)
    model = Net().to(ctx.device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(batch):
        model(batch[0]).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()

    return model, lambda: (torch.randn(4, 16, device=ctx.device),), step


def test_a_module_returning_a_dict_gets_its_backward_markers(tmp_path):
    """``body`` returns a dict: its backward begins once both outputs' gradients exist (after
    ``head``'s) and ends once its input's gradient does (after ``body.inner``'s), as torch's
    full backward hooks place a Tensor-returning module's; the same on cpu and on fake."""
    spec = as_entrypoint(net_step, "dict_output_net")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # torch's "should be a Tensor" one, too
        paths = [capture_real(spec, tmp_path / "real"), capture_fake(spec, tmp_path / "fake")]
    expected = [module_range_name(q, k) for q, k in [
        ("head", BWD_BEGIN), ("head", BWD_END), ("body", BWD_BEGIN), ("body.inner", BWD_BEGIN),
        ("body.inner", BWD_END), ("body", BWD_END), ("pre", BWD_BEGIN), ("pre", BWD_END)]]
    for path in paths:
        assert _markers(path) == expected, path


def qwen2_step(ctx):
    """A tiny transformers Qwen2ForCausalLM, HF's own loss, AdamW(foreach=True)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                      attn_implementation="sdpa")
    model = Qwen2ForCausalLM(cfg).to(ctx.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)

    def step(batch):
        model(input_ids=batch[0], labels=batch[0]).loss.backward()
        opt.step()
        opt.zero_grad()

    return model, lambda: (torch.randint(0, 64, (2, 8), device=ctx.device),), step


def test_qwen2_foreach_adamw_on_fake_records_and_replays_the_real_ops(tmp_path):
    """The same op histogram as a real cpu capture; every op replays (the fake trace used to
    hold the fake mode's constant propagation of the foreach step's ``torch.tensor(1.0)``: an
    extra ``clone``, and a ``detach_`` the replay refused: "Can't detach views in-place");
    ``model`` (a Qwen2Model, returning a ModelOutput) gets backward markers."""
    pytest.importorskip("transformers")
    from actors.replay.config import AllocationConfig, ReplayConfig
    from actors.replay.engine import ReplayEngine

    real, fake = compare_fake_to_real(as_entrypoint(qwen2_step, "qwen2_foreach_adamw"), tmp_path)
    assert sum(op.name == "aten::detach_" for op in fake.ops) > 0
    runs = [ReplayEngine(t, ReplayConfig(mode="compute", device="cpu", iters=1, warmup_iters=0,
                                         allocation=AllocationConfig(mode="lazy"))).run().to_dict()
            for t in (real, fake)]
    assert [r["status"] for r in runs] == ["ok", "ok"], [r["error"] for r in runs]
    assert [r["skipped_reasons"] for r in runs] == [{}, {}]
    assert runs[0]["num_replayed"] == runs[1]["num_replayed"] == len(fake.ops)
    for side in ("real", "fake"):
        markers = _markers(tmp_path / side / "rank-0.et.json.gz")
        assert {module_range_name("model", k) for k in (BWD_BEGIN, BWD_END)} <= set(markers)


class InPlaceBlock(nn.Module):
    """ResNet's shape: conv, BatchNorm, ReLU(inplace=True), ``out += identity``, ReLU again;
    and an embedding (whose input needs no grad) in front."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.conv, self.bn, self.relu = nn.Conv1d(4, 4, 1), nn.BatchNorm1d(4), nn.ReLU(True)

    def forward(self, idx):
        x = self.relu(self.emb(idx).transpose(1, 2).contiguous())
        out = self.bn(self.conv(x))
        out += x
        return self.relu(out)


def in_place_step(ctx):
    torch.manual_seed(0)
    model = InPlaceBlock().to(ctx.device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(batch):
        model(batch[0]).sum().backward()
        opt.step()
        opt.zero_grad()

    return model, lambda: (torch.randint(0, 10, (2, 3), device=ctx.device),), step


def test_in_place_ops_on_module_outputs_capture_with_markers(tmp_path):
    """torch's full backward hooks failed this forward ("Output 0 of BackwardHookFunction is a
    view and is being modified inplace"); the graph's hooks see it through, on cpu and fake.
    The embedding's end follows its backward op (torch's hook fired at its begin)."""
    real, fake = compare_fake_to_real(as_entrypoint(in_place_step, "in_place_block"), tmp_path)
    for side in ("real", "fake"):
        path = tmp_path / side / "rank-0.et.json.gz"
        markers = _markers(path)
        for name in ("conv", "bn", "emb"):
            begin, end = (module_range_name(name, k) for k in (BWD_BEGIN, BWD_END))
            assert markers.index(begin) < markers.index(end), (side, name)
        assert markers.count(module_range_name("relu", BWD_BEGIN)) == 2  # called twice
        with gzip.open(path) as f:
            nodes = sorted(orjson.loads(f.read())["nodes"], key=lambda n: n["id"])
        names = [n["name"] for n in nodes]
        emb = names.index(module_range_name("emb", BWD_BEGIN))
        assert "aten::embedding_backward" in names[emb:names.index(
            module_range_name("emb", BWD_END))]
