"""orchestrator/cli/schemas.py: ``register_all`` registers every schema the three commands
compose with, each once (the group schemas are the same classes under every command), and
again without harm."""
from __future__ import annotations

import yaml
from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from orchestrator.cli.schemas import register_all
from orchestrator.config import CONF_DIR, STORED_CHOICES, compose as compose_preset


def _schemas_named_in_conf() -> set[str]:
    """Every ConfigStore entry conf/ names: the root configs' first default and each preset's
    ``schema`` line (a group's own, ``<group>/schema``, or an absolute ``/name@package``)."""
    named = set()
    for path in CONF_DIR.rglob("*.yaml"):
        group = path.parent.relative_to(CONF_DIR).as_posix()
        for entry in (yaml.safe_load(path.read_text()) or {}).get("defaults") or []:
            if not isinstance(entry, str) or entry == "_self_":
                continue
            name = entry.split("@")[0]
            if name.startswith("/"):
                named.add(name[1:])
            elif "schema" in name:
                named.add(name if group == "." else f"{group}/{name}")
    return named


def _stored() -> set[str]:
    out = set()

    def walk(node: dict, prefix: str) -> None:
        for key, value in node.items():
            if isinstance(value, dict):
                walk(value, f"{prefix}{key}/")
            else:
                out.add(f"{prefix}{key.removesuffix('.yaml')}")

    walk(ConfigStore.instance().repo, "")
    return out


def test_every_schema_conf_names_is_registered_with_the_stored_choices(monkeypatch):
    store = ConfigStore.instance()
    # a store holding Hydra's own entries only: none left by another test's registration
    monkeypatch.setattr(store, "repo", {k: v for k, v in store.repo.items()
                                        if k in ("hydra", "_dummy_empty_config_.yaml")})
    register_all()
    stored = _stored()
    named = _schemas_named_in_conf()
    assert {"run_schema", "capture_schema", "predict_schema", "fit_search_schema",
            "workload/schema", "cluster/schema", "target/schema"} <= named
    assert named <= stored, sorted(named - stored)
    for group, choices in STORED_CHOICES.items():
        assert {f"{group}/{c}" for c in choices} <= stored


def test_register_all_twice_and_each_command_composes():
    register_all()
    register_all()  # idempotent: the same nodes again
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        run = compose(config_name="tracefleet", overrides=["replay=dry_run"])
        capture = compose(config_name="capture", overrides=["workload=llama_8b"])
        predict = compose(config_name="predict", overrides=["workload=llama3_8b",
                                                            "world_size=8"])
        search = compose(config_name="predict", overrides=["experiment=fit_search"])
    assert OmegaConf.get_type(run).__name__ == "RunConfig"
    assert OmegaConf.get_type(capture).__name__ == "CaptureConfig"
    assert OmegaConf.get_type(predict).__name__ == "PredictConfig"
    assert OmegaConf.get_type(search).__name__ == "FitSearchRunConfig"
    # the one WorkloadConfig under both commands that compose the group
    assert OmegaConf.get_type(capture.workload) is OmegaConf.get_type(predict.workload)
    assert run.replay.device == "meta"  # replay=dry_run, a registered choice


def test_register_all_stores_nothing_when_the_schemas_are_there(monkeypatch):
    """Every compose calls register_all: once stored, a call stores nothing (storing is ~0.9 s
    of OmegaConf a call, which the fuzz campaign's config cases paid 29 times)."""
    register_all()
    stored: list = []
    monkeypatch.setattr(ConfigStore, "store", lambda self, **kw: stored.append(kw))
    register_all()
    assert stored == []


def test_a_preset_composes_with_no_registration_first(monkeypatch):
    """orchestrator.config.compose stores the group schemas itself: a study composing a
    workload preset (study_traces.workload_config) needs no command to have registered them."""
    store = ConfigStore.instance()
    monkeypatch.setattr(store, "repo", {k: v for k, v in store.repo.items()
                                        if k in ("hydra", "_dummy_empty_config_.yaml")})
    workload = compose_preset(None, ["+workload=qwen3_32b"]).workload
    assert OmegaConf.get_type(workload).__name__ == "WorkloadConfig"
    assert "schema.yaml" in store.repo["workload"] and "run_schema.yaml" not in store.repo
