"""README.md's code blocks keep working as written, checked without running a job.

Every shell line of a fenced bash/sh/console block that calls a tracefleet console script (or
``scripts/run.sh``, whose arguments go to ``tracefleet``) names a script pyproject.toml
declares, and its Hydra overrides compose (and validate) the way the command composes them, or
its argparse flags parse with the command's own parser; every Python block compiles and its
imports resolve (``predict(...)`` composes its config, stopped before the prediction).
``source scripts/env.sh`` comes before the first command that needs the venv, and works from
any directory without touching the shell that sources it.
"""
from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import inspect
import itertools
import os
import re
import shlex
import subprocess
import sys
import tomllib
import typing
from dataclasses import dataclass
from pathlib import Path

import pytest

from orchestrator.cli.schemas import register_all
from orchestrator.config import CONF_DIR, REPO_ROOT

README = REPO_ROOT / "README.md"
ENV_SH = REPO_ROOT / "scripts" / "env.sh"
RUN_SH = REPO_ROOT / "scripts" / "run.sh"
SCRIPTS = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["scripts"]
SHELL_LANGS = {"bash", "sh", "shell", "console"}
# console script -> the conf/<name>.yaml its @hydra.main composes; the others use argparse
HYDRA_APPS = {"tracefleet": "tracefleet", "tracefleet-predict": "predict",
              "tracefleet-capture": "capture"}
ARGPARSE_TOOLS = {"tracefleet-report", "tracefleet-compare", "tracefleet-inspect"}
HYDRA_FLAGS = {"--multirun", "-m", "--debug"}
SCRIPT_NAME = re.compile(r"tracefleet(-[a-z]+)*")
ENV_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")
ENTRYPOINT = re.compile(r"(?P<path>[\w./-]+\.py):(?P<func>\w+)")
FENCE = re.compile(r"^```(?P<lang>[\w-]*)[ \t]*\n(?P<body>.*?)^```[ \t]*$", re.M | re.S)


@dataclass
class Block:
    lang: str
    body: str
    offset: int  # of the block's body in the file
    line: int


@dataclass
class Command:
    script: str  # the console script it runs
    args: list[str]
    text: str
    offset: int
    via_run_sh: bool = False

    def __str__(self) -> str:
        return f"README.md: `{self.text}`"


def blocks(text: str) -> list[Block]:
    return [Block(m["lang"], m["body"], m.start("body"), text.count("\n", 0, m.start("body")) + 1)
            for m in FENCE.finditer(text)]


def shell_commands(block: Block) -> list[Command]:
    """The console-script calls of a shell block (continuations joined, comments dropped; in a
    console block only the ``$ `` lines)."""
    lines, offsets, pending, start = [], [], "", 0
    pos = block.offset
    for raw in block.body.splitlines(keepends=True):
        line = raw.rstrip("\n")
        if block.lang == "console":
            line = line[2:] if line.startswith("$ ") else ("" if not pending else line)
        if not pending:
            start = pos
        pos += len(raw)
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        lines.append(pending + line)
        offsets.append(start)
        pending = ""
    out = []
    for line, offset in zip(lines, offsets):
        words = shlex.split(line, comments=True)
        separated = itertools.groupby(words, lambda w: w in {"&&", "||", ";", "|"})
        for part in (list(g) for sep, g in separated if not sep):
            while part and ENV_ASSIGNMENT.match(part[0]):
                part = part[1:]
            if not part:
                continue
            name = os.path.basename(part[0])
            text = " ".join(words)
            if part[0].endswith("scripts/run.sh"):
                out.append(Command("tracefleet", part[1:], text, offset, via_run_sh=True))
            elif SCRIPT_NAME.fullmatch(name):
                out.append(Command(name, part[1:], text, offset))
    return out


README_TEXT = README.read_text()
BLOCKS = blocks(README_TEXT)
COMMANDS = [c for b in BLOCKS if b.lang in SHELL_LANGS for c in shell_commands(b)]
PYTHON_BLOCKS = [b for b in BLOCKS if b.lang == "python"]


# ---- the checks, also applied below to commands the README does not hold -----------------

class _Stop(Exception):
    """Raised where the checked command would start its work."""

    def __init__(self, value):
        super().__init__(value)
        self.value = value


def _entry(script: str):
    module, func = SCRIPTS[script].split(":")
    return importlib.import_module(module), func


def _composed(script: str, overrides: list[str], with_hydra: bool = False):
    """The command's config (a DictConfig) for ``overrides``, composed as its module does;
    ``with_hydra``: with its ``hydra`` node (where a sweep's params are)."""
    from hydra import compose, initialize_config_dir

    register_all()  # as the command does in main(); idempotent
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name=HYDRA_APPS[script], overrides=overrides,
                       return_hydra_config=with_hydra)


def _validated(cfg):
    if hasattr(cfg, "validate"):
        cfg.validate()
    return cfg


def compose_hydra(script: str, overrides: list[str]) -> list:
    """``overrides`` composed to the command's config object and validated, as the command
    does before running; with ``--multirun``, one object per point of the sweep."""
    from hydra.core.config_store import ConfigStore
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf, open_dict

    flags = [a for a in overrides if a.startswith("-")]
    unknown = set(flags) - HYDRA_FLAGS
    assert not unknown, f"{script}: flags this test does not know: {sorted(unknown)}"
    plain = [a for a in overrides if not a.startswith("-")]
    if not {"--multirun", "-m"} & set(flags):
        if script == "tracefleet-predict":
            return [_validated(_entry(script)[0].predict_config(*plain))]  # the command's own
        return [_validated(OmegaConf.to_object(_composed(script, plain)))]
    # A sweep: the points Hydra's basic sweeper runs, the config's hydra.sweeper.params and the
    # command line's sweeps (which win). A config group is composed per value; a value is
    # merged into the composed config (type-checked by its schema): one compose per group point.
    parser = OverridesParser.create()
    parsed = parser.parse_overrides(plain)
    fixed = [o.input_line for o in parsed if not o.is_sweep_override()]
    full = _composed(script, fixed, with_hydra=True)
    params = OmegaConf.select(full, "hydra.sweeper.params")
    swept = {o.get_key_element(): list(o.sweep_string_iterator())
             for o in parser.parse_overrides([f"{k}={v}" for k, v in (params or {}).items()])}
    for o in parsed:
        if o.is_sweep_override():
            swept[o.get_key_element()] = list(o.sweep_string_iterator())
        else:
            swept.pop(o.get_key_element(), None)
    repo = ConfigStore.instance().repo
    groups = [k for k in swept if isinstance(repo.get(k), dict) or (CONF_DIR / k).is_dir()]
    values = [k for k in swept if k not in groups]
    out = []
    for group_point in itertools.product(*(swept[k] for k in groups)):
        if groups:
            base = _composed(script, fixed + [f"{k}={v}" for k, v in zip(groups, group_point)])
        else:  # the config composed above, without its hydra node
            base = full.copy()
            with open_dict(base):
                del base["hydra"]
        for value_point in itertools.product(*(swept[k] for k in values)):
            cfg = OmegaConf.merge(base, OmegaConf.from_dotlist(
                [f"{k}={v}" for k, v in zip(values, value_point)]))
            out.append(_validated(OmegaConf.to_object(cfg)))
    return out


def parse_argparse(script: str, args: list[str], monkeypatch) -> argparse.Namespace:
    """``args`` parsed by the command's own parser (built in its ``main``), stopped there."""
    module, func = _entry(script)
    parse = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        raise _Stop(parse(self, args, namespace))

    with monkeypatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
        m.setattr(sys, "argv", [script, *args])
        try:
            getattr(module, func)()
        except _Stop as stop:
            return stop.value
        except SystemExit as e:
            pytest.fail(f"{script} {' '.join(args)}: its parser refuses it (exit {e.code})")
    pytest.fail(f"{script}: main() returned without parsing its arguments")


def check_command(cmd: Command, monkeypatch) -> None:
    """A declared console script; a ``PATH.py:FUNC`` it names exists; its Hydra overrides
    compose and validate, or its argparse arguments parse (run from the repo's root)."""
    assert cmd.script in SCRIPTS, \
        f"{cmd}: {cmd.script} is not a console script of pyproject.toml ({sorted(SCRIPTS)})"
    for arg in cmd.args:  # a file the command names in the repo (the README runs from its root)
        m = ENTRYPOINT.search(arg)
        if m:
            path = REPO_ROOT / m["path"]
            assert path.is_file(), f"{cmd}: no {m['path']}"
            defined = {n.name for n in ast.parse(path.read_text()).body
                       if isinstance(n, ast.FunctionDef)}
            assert m["func"] in defined, f"{cmd}: {m['path']} defines no {m['func']}()"
    if cmd.script in HYDRA_APPS:
        monkeypatch.chdir(REPO_ROOT)
        try:
            compose_hydra(cmd.script, cmd.args)
        except Exception as e:  # noqa: BLE001 - Hydra's, OmegaConf's and ConfigError alike
            pytest.fail(f"{cmd}: does not compose: {type(e).__name__}: {e}")
    else:
        assert cmd.script in ARGPARSE_TOOLS, f"{cmd}: add {cmd.script} to this test's tables"
        parse_argparse(cmd.script, cmd.args, monkeypatch)


def check_python(block: Block, monkeypatch) -> None:
    """Compiles; every import resolves; a call of an imported function binds its signature
    (``tracefleet.predict``: composes and validates its config, stopped before predicting);
    attributes read off its result exist on the annotated return type."""
    import tracefleet.api

    where = f"README.md:{block.line}"
    compile(block.body, where, "exec")
    tree = ast.parse(block.body, where)
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                assert importlib.util.find_spec(alias.name), f"{where}: no module {alias.name}"
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0 and importlib.util.find_spec(node.module), \
                f"{where}: no module {node.module}"
            module = importlib.import_module(node.module)
            for alias in node.names:
                found = hasattr(module, alias.name) or \
                    importlib.util.find_spec(f"{node.module}.{alias.name}") is not None
                assert found, f"{where}: {node.module} has no {alias.name}"
                names[alias.asname or alias.name] = getattr(module, alias.name, None)
    results = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and \
                isinstance(node.value.func, ast.Name) and callable(names.get(node.value.func.id)):
            func, call = names[node.value.func.id], node.value
            try:
                args = [ast.literal_eval(a) for a in call.args]
                kwargs = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
            except ValueError:  # not literals (a variable, ``**opts``): not checked
                continue
            try:
                inspect.signature(func).bind(*args, **kwargs)
            except TypeError as e:
                pytest.fail(f"{where}: {ast.unparse(call)}: {e}")
            if func is tracefleet.api.predict:
                _compose_predict(func, args, kwargs, where, monkeypatch)
            returns = typing.get_type_hints(func).get("return")
            for target in node.targets:
                if isinstance(target, ast.Name) and isinstance(returns, type):
                    results[target.id] = returns
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and \
                node.value.id in results:
            assert hasattr(results[node.value.id], node.attr), \
                f"{where}: {results[node.value.id].__name__} has no {node.attr}"


def _compose_predict(func, args, kwargs, where, monkeypatch) -> None:
    import orchestrator.studies.predict as study
    from orchestrator.studies.predict import PredictConfig

    def validate_and_stop(cfg, *_, **__):
        cfg.validate()
        raise _Stop(cfg)

    with monkeypatch.context() as m:
        m.setattr(study, "predict", validate_and_stop)
        m.chdir(REPO_ROOT)
        try:
            func(*args, **kwargs)
        except _Stop as stop:
            cfg = stop.value
        except Exception as e:  # noqa: BLE001 - its ConfigError, or a defect
            pytest.fail(f"{where}: does not compose: {type(e).__name__}: {e}")
        else:
            pytest.fail(f"{where}: predict() returned without composing a config")
    assert isinstance(cfg, PredictConfig), where


# ---- the README ----------------------------------------------------------------------------

def test_the_readme_has_what_this_test_reads():
    assert {"tracefleet", "tracefleet-predict"} <= {c.script for c in COMMANDS}
    assert PYTHON_BLOCKS, "README.md: no ```python block left"


def test_this_test_knows_every_console_script():
    assert set(HYDRA_APPS) | ARGPARSE_TOOLS == set(SCRIPTS), \
        "pyproject.toml's [project.scripts] changed: update HYDRA_APPS / ARGPARSE_TOOLS here"


@pytest.mark.parametrize("cmd", COMMANDS, ids=lambda c: c.text[:60])
def test_readme_command(cmd, monkeypatch):
    check_command(cmd, monkeypatch)


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=lambda b: f"line{b.line}")
def test_readme_python_block(block, monkeypatch):
    check_python(block, monkeypatch)


def test_env_sh_comes_before_the_first_command_needing_the_venv():
    needs_venv = [c.offset for c in COMMANDS if not c.via_run_sh] + \
                 [b.offset for b in PYTHON_BLOCKS]
    first = min(needs_venv)
    said = README_TEXT.find("source scripts/env.sh")
    line = README_TEXT.count("\n", 0, first) + 1
    assert 0 <= said < first, f"README.md: say `source scripts/env.sh` before line {line}"


def test_run_sh_ends_by_pointing_at_env_sh(monkeypatch):
    text = RUN_SH.read_text()
    assert "env.sh" in text
    hints = re.findall(r'echo "\[tracefleet\]\s+(tracefleet-[^"]*)"', text)
    assert hints, "scripts/run.sh no longer shows an example command"
    for hint in hints:  # the same checks as the README's (a <placeholder> is one argument)
        words = shlex.split(re.sub(r"<[^>]+>", "PLACEHOLDER", hint))
        check_command(Command(words[0], words[1:], hint, 0), monkeypatch)


# ---- scripts/env.sh ------------------------------------------------------------------------

def _shell_env(**extra) -> dict:
    """The environment of a new shell: no venv active, none on PATH, no PYTHONPATH."""
    venv_bin = str(Path(sys.prefix) / "bin")
    env = {k: v for k, v in os.environ.items() if k not in {"VIRTUAL_ENV", "PYTHONPATH"}}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if p and Path(p).resolve() != Path(venv_bin).resolve())
    return {**env, **extra}


def test_env_sh_activates_the_venv_from_any_directory(tmp_path):
    stamp = Path(sys.prefix) / ".tracefleet-installed"
    pyproject = REPO_ROOT / "pyproject.toml"
    if not stamp.is_file() or pyproject.stat().st_mtime > stamp.stat().st_mtime:
        pytest.skip(f"{sys.prefix} is not an up-to-date scripts/bootstrap.sh venv: sourcing "
                    "env.sh would install one")
    probe = (f"source {shlex.quote(str(ENV_SH))} && "
             + " && ".join(f"command -v {s}" for s in sorted(SCRIPTS))
             + ' && python -c "import tracefleet; print(tracefleet.__file__)"'
             + ' && case $- in *e*) exit 9;; esac')
    proc = subprocess.run(["bash", "-c", probe], cwd=tmp_path, capture_output=True, text=True,
                          env=_shell_env(TRACEFLEET_VENV=sys.prefix), timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.split()
    assert [Path(p).name for p in lines[:-1]] == sorted(SCRIPTS)
    assert all(Path(p).parent.resolve() == (Path(sys.prefix) / "bin").resolve()
               for p in lines[:-1])
    assert Path(lines[-1]).resolve() == (REPO_ROOT / "tracefleet" / "__init__.py").resolve()


def test_env_sh_failing_returns_and_leaves_the_shell_as_it_was(tmp_path):
    """A bootstrap that fails (here: no python to make the venv with) returns 1 to the shell
    that sourced env.sh, which goes on with its options untouched (no set -e from
    bootstrap.sh); run instead of sourced, it says so."""
    probe = (f"source {shlex.quote(str(ENV_SH))}; echo \"rc=$? opts=$- "
             "$(set -o | grep -E '^(errexit|nounset|pipefail)' | tr -s ' \\t\\n' ' ')\"")
    proc = subprocess.run(["bash", "-c", probe], cwd=tmp_path, capture_output=True, text=True,
                          env=_shell_env(PYTHON="false", TRACEFLEET_VENV=str(tmp_path / "venv")),
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("rc=1 "), proc.stdout + proc.stderr
    assert "errexit off nounset off pipefail off" in proc.stdout, proc.stdout
    assert "nothing activated" in proc.stderr
    run = subprocess.run(["bash", str(ENV_SH)], cwd=tmp_path, capture_output=True, text=True,
                         env=_shell_env(), timeout=60)
    assert run.returncode == 1 and "source it" in run.stderr


# ---- the checks can fail -------------------------------------------------------------------

@pytest.mark.parametrize("line, why", [
    ("tracefleet-predictor workload=llama3_8b", "not a console script"),
    ("tracefleet-predict workload=llama3_8b world_sise=8", "does not compose"),
    ("tracefleet-predict workload=llama3_8x world_size=8", "does not compose"),
    ("tracefleet-predict workload=llama3_8b target=none", "does not compose"),  # validate()
    ("scripts/run.sh replay.alocation.device_memory_threshold=0.5", "does not compose"),
    ("scripts/run.sh replay.allocation.device_memory_threshold=0.5,0.25", "does not compose"),
    ("scripts/run.sh --multirun replay.allocation.device_memory_threshold=1.0,0.5,oops",
     "does not compose"),
    ("scripts/run.sh --multirun replay.alocation.device_memory_threshold=1.0,0.5",
     "does not compose"),
    ("scripts/run.sh --multirun replay=lazy,nope", "does not compose"),
    ("tracefleet-predict workload=custom workload.entrypoint=examples/nope.py:build",
     "no examples"),
    ("tracefleet-report", "refuses"),
    ("tracefleet-compare gpu.pickle RUN_DIR --rnak 0", "refuses"),
])
def test_a_broken_command_fails(line, why, monkeypatch):
    text = f"```bash\n{line}\n```\n"
    [cmd] = shell_commands(blocks(text)[0])
    with pytest.raises((AssertionError, pytest.fail.Exception), match=why):
        check_command(cmd, monkeypatch)


def test_good_argparse_and_sweep_commands_pass(monkeypatch):
    text = ("```console\n$ tracefleet-compare gpu.pickle RUN_DIR --rank 0 --json\n"
            "output line\n$ tracefleet-report multirun/sweep-1 && "
            "tracefleet-inspect demo/traces/gpt_dp_4 --top 5\n```\n")
    cmds = shell_commands(blocks(text)[0])
    assert [c.script for c in cmds] == ["tracefleet-compare", "tracefleet-report",
                                        "tracefleet-inspect"]
    for cmd in cmds:
        check_command(cmd, monkeypatch)
    assert len(compose_hydra("tracefleet", ["--multirun", "experiment=threshold_sweep"])) == 8


def test_a_broken_python_block_fails(monkeypatch):
    for body, why in [("from tracefleet import predikt\n", "no predikt"),
                      ("p = predict(\n", "never closed|unexpected EOF|was never closed"),
                      ("from tracefleet import predict\np = predict('llama3_8b', wold_size=8)\n",
                       "wold_size"),
                      ("from tracefleet import predict\n"
                       "p = predict('llama3_8b', world_size=8)\np.fitz\n", "no fitz")]:
        with pytest.raises((AssertionError, SyntaxError, pytest.fail.Exception), match=why):
            check_python(Block("python", body, 0, 1), monkeypatch)
