"""``--help`` / ``-h`` of the Hydra apps ``tracefleet``, ``tracefleet-predict`` and
``tracefleet-capture``, answered
before Hydra starts (Hydra's own help is ``--hydra-help``, its composed config ``--cfg job``),
and the experiments each command runs.

The help is read from files, not from imported dataclasses: ``tracefleet-predict``'s schemas
(``PredictConfig``, ``WorkloadConfig``) import torch, seconds a help must not cost. The field
help comes from docs/configuration.md, which scripts/gen_config_docs.py writes from the config
dataclasses' ``setting(..., help=...)`` (tests/test_config_docs.py fails when it is stale); the
groups' choices from ``conf/<group>/*.yaml`` (and those orchestrator/config.py registers,
``STORED_CHOICES``: ``replay=dry_run``); the defaults from the command's root config and its
default presets. Nothing here imports torch, Ray or matplotlib.
"""
from __future__ import annotations

import os
import re
import shutil
import sys
import textwrap
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import yaml

from orchestrator.config import CONF_DIR, REPO_ROOT, STORED_CHOICES
from orchestrator.errors import USER_ERROR_EXIT

HELP_FLAGS = ("-h", "--help")
CONFIG_DOC = REPO_ROOT / "docs" / "configuration.md"
EXPERIMENT = "experiment"
# conf/experiment/ presets only tracefleet-predict runs (their root schema is predict's:
# `tracefleet experiment=fit_search` cannot compose); every other preset there is tracefleet's.
PREDICT_EXPERIMENTS = frozenset({"fit_search"})
_NO_COMMENT_EXPERIMENTS = {"default": "One replay (experiment.search=none)."}


@dataclass(frozen=True)
class Command:
    """What a command's help says beside what it reads from the config files."""

    name: str
    config_name: str  # conf/<config_name>.yaml, its root config
    summary: str
    usage: tuple[str, ...]
    groups_note: dict[str, str]  # group -> a note after its choices
    # (docs/configuration.md section, keys): the fields shown, in this order
    fields: tuple[tuple[str, tuple[str, ...]], ...]
    examples: tuple[tuple[str, str], ...]  # (command line, what it does)
    exit_statuses: tuple[tuple[str, str], ...]
    footer: str


_INTERRUPTED = ("130, 143", "interrupted by Ctrl-C (SIGINT) or SIGTERM: the cleanup ran, every "
                "process the command started is stopped")

COMMANDS = {
    "tracefleet": Command(
        name="tracefleet",
        config_name="tracefleet",
        summary=(
            "Replay PyTorch execution traces (one trace file per rank) on a Ray cluster: one "
            "actor per rank rebuilds the trace's process groups and replays every operator and "
            "collective with torch.distributed (NCCL on GPUs, gloo on CPUs, or the meta device "
            "for a dry run), holding tensor memory as the original run held it, and the driver "
            "writes summary.json, ranks.csv, memory timelines and plots into the run folder "
            "(outputs/DATE/TIME). An experiment makes one replay a study (the smallest device "
            "memory that fits, the OOM study) or, with --multirun, a sweep with one results row "
            "per point. Settings are Hydra overrides: a preset per group (GROUP=CHOICE) and any "
            "key (KEY=VALUE)."),
        usage=("tracefleet [--multirun] [GROUP=CHOICE ...] [KEY=VALUE ...] [--debug]",
               "tracefleet --cfg job [OVERRIDES ...]    print the composed config (Hydra)",
               "tracefleet --hydra-help                 Hydra's own help and flags"),
        groups_note={"trace": "or trace.dir=PATH: your own traces"},
        fields=(
            ("trace", ("trace.dir", "trace.ranks")),
            ("experiment", ("experiment.world_size", "experiment.preflight_only")),
            ("replay", ("replay.mode", "replay.device", "replay.device_memory_capacity",
                        "replay.iters")),
            ("cluster", ("cluster.address",)),
            ("target", ("target.device_memory",)),
        ),
        examples=(
            ("tracefleet", "replay the bundled 4-rank demo traces on a local Ray cluster"),
            ("tracefleet trace.dir=/path/to/rank/traces replay=lazy replay.iters=10",
             "your traces, lazy allocation, 10 measured iterations"),
            ("tracefleet experiment=min_memory",
             "the smallest device memory at which the replay completes"),
            ("tracefleet --multirun experiment=threshold_sweep",
             "a sweep: one results row per point"),
        ),
        exit_statuses=(
            ("0", "the run's status is ok (--multirun: every point's)"),
            ("1", "another status (oom, failed, timeout), or an internal error (a defect: its "
                  "traceback is printed)"),
            ("2", "a user error, printed as one line (a bad override, a trace that cannot be "
                  "read, experiment=fit_search); --debug shows its traceback"),
            _INTERRUPTED,
        ),
        footer=("Hydra: --cfg job prints the composed config, --hydra-help Hydra's own help; "
                "--multirun (-m) runs every combination of comma-separated values (a=1,2). "
                "--debug shows the traceback of a user error."),
    ),
    "tracefleet-predict": Command(
        name="tracefleet-predict",
        config_name="predict",
        summary=(
            "Predict whether a training job fits a GPU's memory, without the GPU: the workload "
            "(a preset, your own training step, or traces you already have) is captured on the "
            "meta or fake device (cached), dry-run with memory held as the original held it and "
            "passed through a model of the target's CUDA caching allocator. It prints one table "
            "with the reserved peak, the headroom and the verdict (fits, too_close or oom) and "
            "writes prediction.json and prediction.html into the run folder (outputs/DATE/TIME). "
            "experiment=fit_search searches the largest local batch, the longest sequence, the "
            "fewest GPUs and the cheapest activation checkpointing that still fit."),
        usage=("tracefleet-predict [GROUP=CHOICE ...] [KEY=VALUE ...] [--debug]",
               "tracefleet-predict --cfg job [OVERRIDES ...]    print the composed config (Hydra)",
               "tracefleet-predict --hydra-help                 Hydra's own help and flags"),
        groups_note={"workload": "or workload=custom workload.entrypoint=PATH.py:FUNCTION",
                     "zero3": "with trace.dir: ZeRO-3 emulation of plain traces"},
        fields=(
            ("tracefleet-predict", ("world_size",)),
            ("workload", ("workload.parallel", "workload.precision",
                          "workload.activation_checkpointing", "workload.seq_len",
                          "workload.batch_size", "workload.entrypoint")),
            ("target", ("target.device_memory",)),
            ("trace (tracefleet-predict)", ("trace.dir",)),
            ("predict (tracefleet-predict)", ("predict.error_band", "predict.cache_dir",
                                              "predict.snapshot")),
            ("fit_search (tracefleet-predict experiment=fit_search)",
             ("fit_search.axes", "fit_search.max_batch_size")),
        ),
        examples=(
            ("tracefleet-predict workload=llama3_8b world_size=8 target=h100_96gb",
             "Llama 3.1 8B, FSDP2, on 8 x H100 96 GB"),
            ("tracefleet-predict workload=custom \\\n"
             "    workload.entrypoint=examples/fsdp2_llama_step.py:build world_size=64 "
             "target=h100_96gb",
             "your own training step"),
            ("tracefleet-predict trace.dir=demo/traces/gpt_dp_4 target=a100_40gb",
             "traces you already have"),
            ("tracefleet-predict experiment=fit_search workload=llama3_70b world_size=64",
             "the largest job that fits"),
        ),
        exit_statuses=(
            ("0", "a prediction, whatever its verdict (fits, too_close, oom: a verdict is a "
                  "result), or a fit_search answer"),
            ("1", "an internal error (a defect: its traceback is printed)"),
            ("2", "a user error, printed as one line (a bad override, a workload that cannot "
                  "run, a tracefleet experiment); --debug shows its traceback"),
            _INTERRUPTED,
        ),
        footer=("Hydra: --cfg job prints the composed config, --hydra-help Hydra's own help. "
                "--debug shows the traceback of a user error. From Python: "
                "tracefleet.predict(...) (README.md)."),
    ),
    "tracefleet-capture": Command(
        name="tracefleet-capture",
        config_name="capture",
        summary=(
            "Train a workload and record one PyTorch execution trace per rank: the traces "
            "tracefleet replays and tracefleet-predict dry-runs. On cpu or cuda one Ray actor "
            "per rank trains it for real (gloo or NCCL) and also records the profiler trace of "
            "the same iteration, eager iteration times and the measured peak memory; on meta or "
            "fake (workload.device) the ranks are recorded in this process over a fake process "
            "group, shapes only, at any world size. Writes rank-<r>.et.json.gz and meta.json "
            "into out_dir (the run folder's traces/ by default)."),
        usage=("tracefleet-capture [GROUP=CHOICE ...] [KEY=VALUE ...] [--debug]",
               "tracefleet-capture --cfg job [OVERRIDES ...]    print the composed config (Hydra)",
               "tracefleet-capture --hydra-help                 Hydra's own help and flags"),
        groups_note={"workload": "or workload=custom workload.entrypoint=PATH.py:FUNCTION"},
        fields=(
            ("tracefleet-capture", ("world_size", "out_dir", "warmup_iters", "overwrite")),
            ("workload", ("workload.model", "workload.parallel", "workload.precision",
                          "workload.device", "workload.entrypoint", "workload.check_fake")),
            ("cluster", ("cluster.address",)),
        ),
        examples=(
            ("tracefleet-capture world_size=4 out_dir=my_traces",
             "the GPT workload on 4 Ray actors (CPU: gloo), its traces in my_traces/"),
            ("tracefleet-capture workload=custom \\\n"
             "    workload.entrypoint=examples/fsdp2_llama_step.py:build world_size=2",
             "your own training step, for real"),
            ("tracefleet-capture workload=llama_70b world_size=8",
             "a 70B preset on the meta device: seconds, shapes only"),
            ("tracefleet-capture workload=custom \\\n"
             "    workload.entrypoint=examples/fsdp2_llama_step.py:build \\\n"
             "    workload.device=fake workload.check_fake=true world_size=2",
             "does the fake capture of your step follow the real one?"),
        ),
        exit_statuses=(
            ("0", "the traces were written (and check_fake found no difference)"),
            ("1", "check_fake found the fake capture parting from the real one (named), or an "
                  "internal error (a defect: its traceback is printed)"),
            ("2", "a user error, printed as one line (a bad override, a workload that cannot "
                  "run, traces already in out_dir without overwrite=true); --debug shows its "
                  "traceback"),
            _INTERRUPTED,
        ),
        footer=("Hydra: --cfg job prints the composed config, --hydra-help Hydra's own help. "
                "--debug shows the traceback of a user error. docs/capture.md tells what is "
                "recorded and how the fake device runs a step."),
    ),
}


def help_requested(argv: list[str]) -> bool:
    """Whether the command line (without the program) asks for this help."""
    return any(a in HELP_FLAGS for a in argv)


def before_hydra(command: str, argv: list[str]) -> int | None:
    """What a console script does before Hydra starts: print the help (``--help``, ``-h``),
    refuse another command's experiment (one line); their exit status, or None to go on."""
    if help_requested(argv):
        try:
            print(render_help(command), flush=True)
        except BrokenPipeError:  # `--help | head`: the reader left; no traceback at exit
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    problem = misplaced_experiment(command, argv)
    if problem is not None:
        print(f"{command}: error: {problem}", file=sys.stderr)
        return USER_ERROR_EXIT
    return None


# -- experiments ----------------------------------------------------------------------------

def experiments(command: str) -> list[str]:
    """The conf/experiment/ presets ``command`` runs (none for a command without the group)."""
    if EXPERIMENT not in root_defaults(COMMANDS[command].config_name):
        return []
    names = sorted(p.stem for p in (CONF_DIR / EXPERIMENT).glob("*.yaml"))
    predict = COMMANDS[command].config_name == "predict"
    return [n for n in names if (n in PREDICT_EXPERIMENTS) == predict]


def misplaced_experiment(command: str, argv: list[str]) -> str | None:
    """The one-line error for an ``experiment=`` override naming another command's experiment
    (Hydra would fail composing it, with a message about schemas); None when there is none."""
    if not experiments(command):
        return None  # Hydra names a group the command does not have
    other = "tracefleet" if command == "tracefleet-predict" else "tracefleet-predict"
    mine, theirs = set(experiments(command)), set(experiments(other))
    for name in _experiment_choices(argv):
        if name in theirs and name not in mine:
            return (f"experiment={name} is a {other} experiment: use `{other} "
                    f"experiment={name}` ({command}'s experiments: "
                    f"{', '.join(sorted(mine)) or 'none'}; {command} --help)")
    return None


def _experiment_choices(argv: list[str]) -> list[str]:
    """The experiment names the overrides in ``argv`` choose (a sweep's every value); an
    override Hydra cannot parse is left for Hydra to report."""
    candidates = [a for a in argv if not a.startswith("-") and "=" in a
                  and a.split("=", 1)[0].lstrip("+~") == EXPERIMENT]
    if not candidates:
        return []
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser, names = OverridesParser.create(), []
    for arg in candidates:
        try:
            override = parser.parse_override(arg)
            if override.is_sweep_override():
                names += list(override.sweep_string_iterator())
            else:
                names.append(override.get_value_element_as_str())
        except Exception:  # noqa: BLE001 (Hydra reports it, with its own message)
            continue
    return names


# -- the help -------------------------------------------------------------------------------

def render_help(command: str, width: int | None = None) -> str:
    """The help of ``command`` (a key of ``COMMANDS``)."""
    cmd = COMMANDS[command]
    width = width or max(60, min(100, shutil.get_terminal_size((100, 24)).columns))
    out = ["usage: " + cmd.usage[0], *("       " + u for u in cmd.usage[1:]), ""]
    out += _wrap(cmd.summary, width)
    out += ["", "Config groups (GROUP=CHOICE; * the default):"]
    defaults = root_defaults(cmd.config_name)
    groups = sorted(defaults, key=lambda g: g == EXPERIMENT)  # experiments last
    pad = max(len(g) for g in groups) + 2
    for group in groups:
        choices = group_choices(command, group)
        shown = ", ".join(c + ("*" if c == defaults[group] else "") for c in choices)
        if defaults[group] is None:
            shown = "none*, " + shown
        note = cmd.groups_note.get(group)
        out += _hanging(f"  {group + '=':<{pad}} ", shown + (f"  ({note})" if note else ""),
                        width)
    names = experiments(command)
    if names:
        out += ["", "Experiments (experiment=NAME):"]
    pad = max((len(n) for n in names), default=0) + 1
    for name in names:
        sweep = " A sweep: run it with --multirun." if _is_sweep(name) else ""
        out += _hanging(f"  {name:<{pad}} ", experiment_summary(name) + sweep, width)
    choices = ", ".join(f"{g}={c}" for g, c in defaults.items() if c is not None)
    out += [""] + _wrap(
        f"Main settings (KEY=VALUE; defaults as composed with {choices}; every key, with its "
        f"default and help: docs/configuration.md):", width)
    try:
        fields = config_fields()
    except OSError as exc:  # not a checkout: the page is not there
        fields = {}
        out.append(f"  (the settings' help is read from {CONFIG_DOC}: {exc.strerror})")
    for section, keys in cmd.fields if fields else ():
        for key in keys:
            default, text = fields[section][key]
            default = preset_default(cmd.config_name, key, default)
            out.append(f"  {key}" + (f"  (default: {default})" if default is not None else ""))
            out += _wrap(text, width, " " * 6)
    out += ["", "Examples:"]
    for line, what in cmd.examples:
        out += [f"  # {what}"] + [f"  {part}" for part in line.splitlines()]
    out += ["", "Exit status:"]
    for code, what in cmd.exit_statuses:
        out += _hanging(f"  {code:<9}", what, width)
    out += [""] + _wrap(cmd.footer, width)
    return "\n".join(out)


def _wrap(text: str, width: int, indent: str = "") -> list[str]:
    return textwrap.wrap(text, width, initial_indent=indent, subsequent_indent=indent,
                         break_on_hyphens=False, break_long_words=False)


def _hanging(head: str, text: str, width: int) -> list[str]:
    return textwrap.wrap(text, width, initial_indent=head, subsequent_indent=" " * len(head),
                         break_on_hyphens=False, break_long_words=False)


def root_defaults(config_name: str) -> dict[str, str | None]:
    """group -> default choice (None: none) of the root config's defaults list."""
    root = _yaml(CONF_DIR / f"{config_name}.yaml")
    out: dict[str, str | None] = {}
    for entry in root.get("defaults", []):
        if isinstance(entry, dict):
            (group, choice), = entry.items()
            if "/" not in group and not group.startswith("override"):
                out[group] = choice
    return out


def group_choices(command: str, group: str) -> list[str]:
    """The choices of ``group`` for ``command``: conf/<group>/*.yaml, then those registered in
    the ConfigStore (config.STORED_CHOICES), experiments: the command's own."""
    if group == EXPERIMENT:
        return experiments(command)
    names = sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))
    return names + sorted(set(STORED_CHOICES.get(group, ())) - set(names))


def experiment_summary(name: str) -> str:
    """The first sentence of the preset's leading comment (up to its first example command
    line), its parentheses left out."""
    lines = []
    for line in (CONF_DIR / EXPERIMENT / f"{name}.yaml").read_text().splitlines():
        if not line.startswith("#"):
            break
        text = line[1:].strip()
        if text.startswith(("tracefleet", '"')):  # an example command line
            if lines:  # it ends the first paragraph
                break
            continue
        if not text.startswith("@package"):
            lines.append(text)
    text = " ".join(" ".join(lines).split())
    while re.search(r"\([^()]*\)", text):
        text = re.sub(r"\s*\([^()]*\)", "", text)
    sentence = re.split(r"(?<=\.)\s", text, maxsplit=1)[0].rstrip(":").rstrip(".")
    return f"{sentence}." if sentence else _NO_COMMENT_EXPERIMENTS.get(name, "")


def _is_sweep(name: str) -> bool:
    return bool((_yaml(CONF_DIR / EXPERIMENT / f"{name}.yaml").get("hydra") or {})
                .get("sweeper"))


def preset_default(config_name: str, key: str, schema_default: str | None) -> str | None:
    """``key``'s value in its group's default preset (conf/<group>/<default>.yaml), else
    ``schema_default`` (the dataclass's, from docs/configuration.md)."""
    group, _, rest = key.partition(".")
    choice = root_defaults(config_name).get(group)
    if not rest or choice is None:
        return schema_default
    node = _yaml(CONF_DIR / group / f"{choice}.yaml")
    for part in rest.split("."):
        if not isinstance(node, dict) or part not in node:
            return schema_default
        node = node[part]
    return _show(node)


def _show(value) -> str:
    """A YAML value as docs/configuration.md shows a default (an empty string as "")."""
    if value == "":
        return '""'
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "[" + ", ".join(_show(v) for v in value) + "]"
    return str(value)


@lru_cache(maxsize=None)
def _yaml(path: Path) -> dict:
    return yaml.safe_load(path.read_text()) or {}


@lru_cache(maxsize=1)
def config_fields() -> dict[str, dict[str, tuple[str | None, str]]]:
    """docs/configuration.md's sections: title -> key -> (default or None, help). The title
    is the heading without backticks (``replay``, ``trace (tracefleet-predict)``)."""
    sections: dict[str, dict[str, tuple[str | None, str]]] = {}
    rows: dict[str, tuple[str | None, str]] | None = None
    for line in CONFIG_DOC.read_text().splitlines():
        if line.startswith("## "):
            rows = sections.setdefault(line[3:].replace("`", "").strip(), {})
        elif rows is not None and line.startswith("| `"):
            cells = [c.strip().replace("\\|", "|")
                     for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
            if len(cells) != 3:
                continue
            key, default, text = cells
            default = (default[1:-1].replace("<repo>", str(REPO_ROOT)) or '""') if default \
                else None
            rows[key.strip("`")] = (default, text)
    return sections
