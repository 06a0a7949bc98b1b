"""docs/configuration.md is generated from the config dataclasses' field help
(scripts/gen_config_docs.py): it fails here when a field's help, default or a group's options
change without the page being regenerated, and when a field has no help."""
from __future__ import annotations

import dataclasses
import importlib.util

import pytest

from actors.config_fields import help_of, setting
from actors.replay.config import AllocationMode, ReplayConfig, dry_run_config
from orchestrator.config import REPO_ROOT
from orchestrator.studies.fit_search_config import FitSearchConfig
from orchestrator.studies.predict import PredictConfig, PredictSettings


def _generator():
    spec = importlib.util.spec_from_file_location("gen_config_docs",
                                                  REPO_ROOT / "scripts" / "gen_config_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_page_is_the_generated_one():
    gen = _generator()
    assert gen.DOC.read_text() == gen.render(), \
        "docs/configuration.md is stale: run python scripts/gen_config_docs.py"


def test_every_key_of_the_run_config_has_its_help():
    assert _generator().undocumented() == []


def test_a_changed_help_changes_the_page(monkeypatch):
    """The check can fail: the page follows the field's metadata."""
    gen = _generator()
    before = gen.render()
    fields = {f.name: f for f in dataclasses.fields(ReplayConfig)}
    monkeypatch.setattr(fields["iters"], "metadata", {"help": "a drifted help"})
    after = gen.render()
    assert after != before and "| `replay.iters` | `20` | a drifted help |" in after


@pytest.mark.parametrize("cls, name, key", [
    (PredictSettings, "error_band", "predict.error_band"),
    (FitSearchConfig, "max_probes", "fit_search.max_probes"),
    (PredictConfig, "world_size", "PredictConfig.world_size"),
])
def test_tracefleet_predicts_keys_are_on_the_page_and_need_their_help(monkeypatch, cls, name,
                                                                      key):
    """tracefleet-predict's root, predict.* and fit_search.* keys are documented too: a field
    that loses its help is reported, a changed help changes the page."""
    gen = _generator()
    f = {f.name: f for f in dataclasses.fields(cls)}[name]
    shown = key.split(".", 1)[1] if cls is PredictConfig else key
    assert f"| `{shown}` | " in gen.render()
    monkeypatch.setattr(f, "metadata", {"help": "a drifted help"})
    assert "a drifted help |" in gen.render()
    monkeypatch.setattr(f, "metadata", {})
    assert gen.undocumented() == [key]


def test_a_setting_needs_its_help():
    with pytest.raises(ValueError, match="help"):
        setting(1, help="")
    f = dataclasses.make_dataclass("C", [("x", int, setting(3, help="three"))])
    assert f().x == 3 and help_of(dataclasses.fields(f)[0]) == "three"


def test_the_dry_run_is_defined_once():
    """replay=dry_run (lazy) and tracefleet-predict's dry run (faithful) differ only in the
    allocation mode."""
    lazy, faithful = dry_run_config(), dry_run_config(AllocationMode.faithful)
    assert (lazy.device, lazy.mode, lazy.warmup_iters, lazy.iters, lazy.measure_memory) == \
        ("meta", "compute", 1, 1, False)
    assert lazy.allocation.mode == AllocationMode.lazy
    assert dataclasses.replace(faithful, allocation=lazy.allocation) == lazy
