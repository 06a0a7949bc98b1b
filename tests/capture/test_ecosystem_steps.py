"""The ecosystem's training steps under examples/ (transformers, PEFT, torchvision, torch.nn
built-ins; FSDP2 and DDP) capture on fake as they run for real: the op histograms of a fake
capture and a real cpu capture are equal, autograd's in-place accumulation folded
(tests/support/fake_vs_real.py), and no op is lost. One real run is enough: the links gloo's
thread used to scramble in about one real DDP run of two are mended by the loader
(actors/trace/parent_links.py)."""
from __future__ import annotations

import importlib.util

import pytest

from orchestrator.config import REPO_ROOT
from tests.support.fake_vs_real import compare_fake_to_real, known_difference

STEPS = {
    "hf_llama_fsdp2_checkpointing": "transformers",
    "hf_qwen2_fsdp2_bf16": "transformers",
    "hf_mixtral_moe_step": "transformers",
    "ddp_gpt2_step": "transformers",
    "transformer_encoder_checkpoint_step": None,
    "ddp_resnet_step": "torchvision",
    "ddp_convnet_checkpoint_step": None,
    "peft_lora_fsdp2_step": "peft",
}


def _importable(name: str | None) -> bool:
    if name is None:
        return True
    try:
        return importlib.util.find_spec(name) is not None and bool(__import__(name))
    except Exception:  # noqa: BLE001 - a library that cannot import here is skipped
        return False


# Under any dispatch mode torch's C++ takes its subclass-like variant of an index backward
# (out-of-place ``index_put`` where real tensors get ``_index_put_impl_``; docs/capture.md,
# "Known differences"): the MoE router's gather is differentiated that way on fake.
# And checkpoint's early stop aborts the recompute's last op (a ReLU) once it has saved its
# output: a real cpu ReLU's own kernel op (``clamp_min``) is written under the lost node, a
# fake one's is the fake mode's (not recorded); both traces hold the same memory.
KNOWN = {"ddp_convnet_checkpoint_step": "aten::clamp_min: real 2, fake 0",
         "hf_mixtral_moe_step": "aten::_index_put_impl_: real 8, fake 0; aten::empty_strided: "
                                "real 0, fake 3; aten::index_put: real 0, fake 8; aten::mul_: "
                                "real 21, fake 24"}


@pytest.mark.parametrize("name", sorted(set(STEPS) - set(KNOWN)))
def test_ecosystem_step_on_fake_records_the_real_ops(name, tmp_path):
    if not _importable(STEPS[name]):
        pytest.skip(f"{STEPS[name]} does not import here")
    spec = f"{REPO_ROOT / 'examples' / name}.py:build"
    real, fake = compare_fake_to_real(spec, tmp_path)
    for trace in (real, fake):
        assert trace.meta["num_dropped_ops"] == 0
    assert fake.recorded_frees and len(fake.ops) > 50


@pytest.mark.parametrize("name", sorted(KNOWN))
def test_ecosystem_step_differs_on_fake_only_as_known(name, tmp_path):
    if not _importable(STEPS[name]):
        pytest.skip(f"{STEPS[name]} does not import here")
    spec = f"{REPO_ROOT / 'examples' / name}.py:build"
    assert known_difference(spec, tmp_path) == KNOWN[name]
