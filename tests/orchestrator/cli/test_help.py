"""`tracefleet --help`, `tracefleet-predict --help` and `tracefleet-capture --help`
(orchestrator/cli/usage.py): answered before
Hydra starts, without torch; the field help is the dataclasses', the group choices conf/'s; every
experiment a help lists composes under its command; another command's experiment is one line."""
from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import os
import re
import resource
import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from actors.config_fields import help_of
from orchestrator.cli import usage
from orchestrator.cli.schemas import register_all
from orchestrator.config import CONF_DIR, REPO_ROOT
from orchestrator.errors import USER_ERROR_EXIT

COMMANDS = {"tracefleet": "orchestrator.cli.main", "tracefleet-predict": "orchestrator.cli.predict",
            "tracefleet-capture": "orchestrator.cli.capture"}
HEAVY = ("torch", "ray", "matplotlib")
# CPU seconds of a whole help process (interpreter, hydra and yaml imports, the page read):
# ~0.5 s here; Hydra's own help took ~3 s of CPU and torch's import alone takes more than this.
HELP_CPU_S = 2.5


def _flat(text: str) -> str:
    return " ".join(text.split())


def _cases():
    return [(c, n) for c in COMMANDS for n in usage.experiments(c)]


def _run_help(command: str, flag: str):
    """The console script's main() with ``flag`` in a fresh interpreter under -X importtime;
    (process, CPU seconds it used)."""
    code = (f"import sys; sys.argv[0] = {command!r}; "
            f"from {COMMANDS[command]} import main; main()")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run([sys.executable, "-X", "importtime", "-c", code, flag],
                          capture_output=True, text=True, timeout=120, cwd=REPO_ROOT,
                          env={**os.environ, "PYTHONPATH": str(REPO_ROOT), "COLUMNS": "100"})
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return proc, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


@pytest.mark.parametrize("command, flag", [("tracefleet", "--help"),
                                           ("tracefleet-predict", "--help"),
                                           ("tracefleet-predict", "-h"),
                                           ("tracefleet-capture", "--help")])
def test_help_exits_0_quickly_without_torch(command, flag):
    proc, cpu_s = _run_help(command, flag)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith(f"usage: {command} ")
    assert "powered by Hydra" not in proc.stdout
    imported = {m.group(1) for m in re.finditer(r"^import time:.*\|\s*([\w.]+)\s*$",
                                                proc.stderr, re.M)}
    assert imported, "no -X importtime lines: the check would pass vacuously"
    heavy = sorted(m for m in imported if m.split(".")[0] in HEAVY)
    assert heavy == [], f"--help imported {heavy[:5]}"
    assert cpu_s < HELP_CPU_S, f"--help used {cpu_s:.1f} s of CPU"


def _dataclass_fields():
    """(command, dataclass field) of a few of the fields each help shows."""
    from actors.capture.workloads.config import WorkloadConfig
    from actors.replay.config import ReplayConfig
    from orchestrator.config import TraceConfig
    from orchestrator.studies.predict import PredictConfig, PredictSettings

    def field(cls, name):
        return next(f for f in dataclasses.fields(cls) if f.name == name)

    return [("tracefleet", field(ReplayConfig, "iters")),
            ("tracefleet", field(TraceConfig, "ranks")),
            ("tracefleet-predict", field(PredictConfig, "world_size")),
            ("tracefleet-predict", field(WorkloadConfig, "seq_len")),
            ("tracefleet-predict", field(PredictSettings, "error_band"))]


def test_help_shows_the_dataclasses_field_help():
    pages = {c: _flat(usage.render_help(c, width=100)) for c in COMMANDS}
    for command, f in _dataclass_fields():
        assert help_of(f) and _flat(help_of(f)) in pages[command], (command, f.name)
    # every field a help names is on docs/configuration.md, with its help
    fields = usage.config_fields()
    for command, cmd in usage.COMMANDS.items():
        for section, keys in cmd.fields:
            for key in keys:
                assert _flat(fields[section][key][1]) in pages[command], (command, key)


@pytest.mark.parametrize("command", COMMANDS)
def test_help_lists_the_groups_and_their_choices(command):
    page = usage.render_help(command, width=100)
    defaults = usage.root_defaults(usage.COMMANDS[command].config_name)
    assert defaults
    for group, default in defaults.items():
        line = re.search(rf"\n  {group}=(.*?)(?=\n  \S|\n\n)", page, re.S).group(1)
        listed = _flat(line).split(" (")[0].split(", ")  # a note in parentheses follows
        files = sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))
        if group == "experiment":
            expected = [n for n in files if n in usage.experiments(command)]
            assert [c.rstrip("*") for c in listed] == \
                (["none"] if default is None else []) + expected
        else:
            assert set(files) <= {c.rstrip("*") for c in listed}, (group, listed)
        assert f"{default or 'none'}*" in listed, (group, listed)
    assert "Exit status:" in page and "docs/configuration.md" in page and "--hydra-help" in page
    if command == "tracefleet":
        assert "dry_run" in page  # registered in the ConfigStore, not a file
        assert "fit_search" not in page.split("Experiments")[1].split("Main settings")[0]


def test_each_command_lists_only_its_own_experiments():
    ours = set(usage.experiments("tracefleet"))
    theirs = set(usage.experiments("tracefleet-predict"))
    assert theirs == {"fit_search"} and ours and not ours & theirs
    assert ours | theirs == {p.stem for p in (CONF_DIR / "experiment").glob("*.yaml")}


def _compose_tracefleet(*overrides: str):
    """tracefleet's config as its Hydra app composes it, then the object its task builds."""
    register_all()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return OmegaConf.to_object(compose(config_name="tracefleet", overrides=list(overrides)))


def _compose_capture():
    """tracefleet-capture's config as its Hydra app composes it: a container, since out_dir
    interpolates the run folder only a running Hydra app knows."""
    register_all()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return OmegaConf.to_container(compose(config_name="capture"), resolve=False)


def _sweep_points(name: str):
    """An experiment's sweep (hydra.sweeper.params) as single overrides, each value once."""
    params = (usage._yaml(CONF_DIR / "experiment" / f"{name}.yaml").get("hydra") or {}) \
        .get("sweeper", {}).get("params", {})
    return [f"{k}={v.strip()}" for k, vs in params.items() for v in str(vs).split(",")]


@pytest.mark.parametrize("command, name", _cases())
def test_every_listed_experiment_composes(command, name):
    if command == "tracefleet":
        from orchestrator.config import RunConfig

        cfg = _compose_tracefleet(f"experiment={name}")
        assert isinstance(cfg, RunConfig)
        for point in _sweep_points(name):  # --multirun: each point adds one of these
            assert isinstance(_compose_tracefleet(f"experiment={name}", point), RunConfig)
    else:
        from orchestrator.cli.predict import predict_config
        from orchestrator.studies.fit_search_config import FitSearchRunConfig
        from orchestrator.studies.predict import PredictConfig

        cfg = predict_config(f"experiment={name}")
        assert isinstance(cfg, PredictConfig)
        if name == "fit_search":
            assert isinstance(cfg, FitSearchRunConfig)


def test_predict_without_an_experiment_composes():
    """``none``, the default tracefleet-predict's help lists beside its experiments."""
    from orchestrator.cli.predict import predict_config
    from orchestrator.studies.predict import PredictConfig

    assert type(predict_config()) is PredictConfig


def _docs_show():
    spec = importlib.util.spec_from_file_location("gen_config_docs",
                                                  REPO_ROOT / "scripts" / "gen_config_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module._show


@pytest.mark.parametrize("command", COMMANDS)
def test_the_defaults_shown_are_the_composed_ones(command):
    show = _docs_show()
    if command == "tracefleet":
        cfg = search_cfg = _compose_tracefleet()
    elif command == "tracefleet-capture":
        cfg = search_cfg = _compose_capture()
    else:
        from orchestrator.cli.predict import predict_config
        cfg, search_cfg = predict_config(), predict_config("experiment=fit_search")
    shown = re.findall(r"^  (\S+)  \(default: (.*)\)$", usage.render_help(command, width=100),
                       re.M)
    assert len(shown) >= 8
    for key, default in shown:
        # fit_search.* is there with experiment=fit_search only
        value = functools.reduce(lambda node, k: node[k] if isinstance(node, dict) else
                                 getattr(node, k), key.split("."),
                                 search_cfg if key.startswith("fit_search.") else cfg)
        expected = '""' if value == "" else show(value).replace("<repo>", str(REPO_ROOT))
        assert default == expected, key


def test_tracefleet_cannot_compose_fit_search():
    """Why tracefleet refuses it up front: its root schema is tracefleet-predict's."""
    with pytest.raises(Exception, match="fit_search_schema"):
        _compose_tracefleet("experiment=fit_search")


@pytest.mark.parametrize("command, argv, other", [
    ("tracefleet", ["experiment=fit_search"], "tracefleet-predict"),
    ("tracefleet", ["--multirun", "experiment=min_memory,fit_search", "--debug"],
     "tracefleet-predict"),
    ("tracefleet", ["+experiment=fit_search", "trace.dir=x"], "tracefleet-predict"),
    ("tracefleet-predict", ["experiment=min_memory", "world_size=8"], "tracefleet"),
])
def test_another_commands_experiment_is_one_line_and_exit_2(command, argv, other, monkeypatch,
                                                              capsys):
    main = importlib.import_module(COMMANDS[command]).main
    monkeypatch.setattr(sys, "argv", [command, *argv])
    with pytest.raises(SystemExit) as exit_:
        main()
    assert exit_.value.code == USER_ERROR_EXIT
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1, err
    name = "fit_search" if other == "tracefleet-predict" else "min_memory"
    assert err.startswith(f"{command}: error: experiment={name} ")
    assert f"use `{other} experiment={name}`" in err


def test_own_experiments_and_other_overrides_are_not_refused():
    assert usage.misplaced_experiment("tracefleet", ["experiment=min_memory", "-m",
                                                     "replay.iters=1,2"]) is None
    assert usage.misplaced_experiment("tracefleet-predict", ["experiment=fit_search"]) is None
    assert usage.misplaced_experiment("tracefleet", ["experiment=nope"]) is None  # Hydra's to say
    assert usage.misplaced_experiment("tracefleet", ["experiment.name=fit_search"]) is None


def test_hydras_own_help_and_cfg_still_work(tmp_path):
    entry = [sys.executable, "-c", "from orchestrator.cli.main import main; main()"]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    hydra_help = subprocess.run([*entry, "--hydra-help"], capture_output=True, text=True,
                                timeout=120, cwd=tmp_path, env=env)
    assert hydra_help.returncode == 0 and "Hydra" in hydra_help.stdout, hydra_help.stderr
    cfg = subprocess.run([*entry, "--cfg", "job", "experiment=min_memory"], capture_output=True,
                         text=True, timeout=120, cwd=tmp_path, env=env)
    assert cfg.returncode == 0, cfg.stderr
    assert "search: min_memory" in cfg.stdout and "usage:" not in cfg.stdout
    assert list(tmp_path.iterdir()) == []  # neither made a run dir
