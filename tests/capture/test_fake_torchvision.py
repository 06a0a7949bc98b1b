"""torchvision models on workload.device=fake, each a small SGD step captured on fake and for real
on cpu (tests/support/fake_vs_real.py). They need the recorder's backward markers not to wrap
tensors (ResNet's ``out += identity`` and ``ReLU(inplace=True)`` failed under torch's full
backward hooks, on cpu too) and ``nn.init.trunc_normal_`` skipped on fake (ViT). Skipped when
torchvision does not import (scripts/bootstrap.sh installs it beside the CPU torch)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from actors.trace import load_trace
from tests.support.fake_vs_real import (as_entrypoint, capture_fake, compare_fake_to_real,
                                        known_difference)

try:  # PyPI's wheel beside a CPU torch: its C ops fail, its models import with the shim
    import torchvision.models as tvm
    from torchvision.models.swin_transformer import SwinTransformer
    from torchvision.models.vision_transformer import VisionTransformer
except Exception as e:  # noqa: BLE001 (RuntimeError "torchvision::nms does not exist", ...)
    pytest.skip(f"torchvision does not import: {e}", allow_module_level=True)

NUM_CLASSES, SIZE = 10, 32


def vision_step(make_model, autocast=None):
    """A build(ctx): ``make_model().to(ctx.device)``, SGD with momentum, cross-entropy on a
    batch of two 32x32 images (under ``torch.autocast(autocast)`` when given)."""
    def build(ctx):
        torch.manual_seed(0)
        model = make_model().to(ctx.device)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

        def step(batch):
            x, y = batch
            with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
                loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()

        return model, lambda: (torch.randn(2, 3, SIZE, SIZE, device=ctx.device),
                               torch.randint(0, NUM_CLASSES, (2,), device=ctx.device)), step
    return build


def small_vit():  # vit_b_16's class and code, 2 layers of width 32
    return VisionTransformer(image_size=SIZE, patch_size=16, num_layers=2, num_heads=2,
                             hidden_dim=32, mlp_dim=64, num_classes=NUM_CLASSES)


def small_swin():
    return SwinTransformer(patch_size=[4, 4], embed_dim=16, depths=[1, 1], num_heads=[1, 2],
                           window_size=[2, 2], num_classes=NUM_CLASSES)


MODELS = {
    "resnet18": vision_step(lambda: tvm.resnet18(num_classes=NUM_CLASSES)),
    "resnet18_bf16_autocast": vision_step(lambda: tvm.resnet18(num_classes=NUM_CLASSES),
                                          torch.bfloat16),
    "vit_small": vision_step(small_vit),
    "mobilenet_v2": vision_step(lambda: tvm.mobilenet_v2(num_classes=NUM_CLASSES,
                                                         width_mult=0.25)),
    "mobilenet_v3_small": vision_step(lambda: tvm.mobilenet_v3_small(num_classes=NUM_CLASSES)),
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_torchvision_model_on_fake_records_the_real_ops(name, tmp_path):
    real, fake = compare_fake_to_real(as_entrypoint(MODELS[name], f"tv_{name}"), tmp_path)
    assert any(op.name == "aten::convolution_backward" for op in fake.ops)


def test_vit_b_16_at_full_size_captures_on_fake(tmp_path):
    """The 86M-parameter vit_b_16 itself (trunc_normal_ init), on fake only."""
    path = capture_fake(as_entrypoint(vision_step(lambda: tvm.vit_b_16(
        num_classes=NUM_CLASSES, image_size=SIZE)), "tv_vit_b_16"), tmp_path)
    trace = load_trace(path)
    assert sum(op.name == "aten::_native_multi_head_attention" or
               op.name.startswith("aten::_scaled_dot_product") for op in trace.ops) >= 12


@pytest.mark.parametrize("name, make_model, expected", [
    # index backward (the relative position bias): out of place for subclass-like tensors
    ("swin", small_swin, "aten::_index_put_impl_: real 2, fake 0; aten::index_put: real 0, "
                         "fake 2"),
    # a view's backward: as_strided on real tensors, the view replayed on subclass-like ones
    ("efficientnet_b0", lambda: tvm.efficientnet_b0(num_classes=NUM_CLASSES),
     "aten::as_strided: real 3, fake 0; aten::copy_: real 3, fake 2; aten::new_zeros: real 1, "
     "fake 0; aten::reshape: real 0, fake 1; aten::view: real 1, fake 2"),
])
def test_subclass_like_backward_formulas_differ_as_counted(name, make_model, expected, tmp_path):
    """Under a dispatch mode every tensor is subclass-like to torch's C++, and a few backward
    formulas then take another, out-of-place or view-replaying, variant: the only differences
    these models show, counted exactly (docs/capture.md lists them)."""
    assert known_difference(as_entrypoint(vision_step(make_model), f"tv_{name}"),
                            tmp_path) == expected
