"""Write docs/configuration.md from the config dataclasses' field help (``setting(...,
help=...)``, actors/config_fields.py): the groups, their options and every key with its
default and help. Edit the help where the field is declared, then run this.

    python scripts/gen_config_docs.py           # rewrite docs/configuration.md
    python scripts/gen_config_docs.py --check   # exit 1 when the page is stale
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from actors.capture.workloads.config import WorkloadConfig  # noqa: E402
from actors.choices import Choice  # noqa: E402
from actors.config_fields import help_of  # noqa: E402
from orchestrator.config import STORED_CHOICES  # noqa: E402 (registered, not in conf/)
from orchestrator.config import CONF_DIR, RunConfig  # noqa: E402
from orchestrator.run.capture import CaptureConfig  # noqa: E402
from orchestrator.studies.fit_search_config import FitSearchConfig, FitSearchRunConfig  # noqa: E402
from orchestrator.studies.predict import (PredictConfig, PredictSettings,  # noqa: E402
                                          PredictTraceConfig)

DOC = ROOT / "docs" / "configuration.md"
# group -> options of conf/<group>/ that are not tracefleet's (tracefleet-predict's)
NOT_RUN = {"experiment": {"fit_search"}}
# groups of tracefleet-predict and tracefleet-capture beside RunConfig's
OTHER_GROUPS = [("workload", WorkloadConfig)]
# tracefleet-predict's own sections (its workload, target, replay and zero3 are the groups above)
PREDICT_SECTIONS = [("predict", PredictSettings, "tracefleet-predict"),
                    ("trace", PredictTraceConfig, "tracefleet-predict"),
                    ("fit_search", FitSearchConfig, "tracefleet-predict experiment=fit_search")]

INTRO = """\
# Configuration

<!-- Written by scripts/gen_config_docs.py from the config dataclasses' field help; edit the
help where the field is declared (setting(..., help=...)) and run the script. -->

Hydra composes `conf/tracefleet.yaml` from one group per axis; each group's fields are
documented on its dataclass (`setting(default, help=...)`, `actors/config_fields.py`), and
every choice is an enum Hydra checks at compose time:
"""

OUTRO = """\
`replay.per_op_timing=true` times every op (the `top_ops` table); off, only whole iterations and
collectives are timed, which keeps the op loop's overhead low. On CUDA,
`replay.cuda_sync_collectives=true` synchronizes the device around every collective for
per-collective timing (off by default: it removes the original's compute/communication overlap).

The world size comes from the traces; a run on fewer ranks than the traces have is refused.
`workload` is the group of `tracefleet-predict` and `tracefleet-capture` (docs/capture.md);
`tracefleet-predict`'s root config and its own `predict.*`, `trace.*` and `fit_search.*` keys
follow the groups (docs/prediction.md tells how they are used), then `tracefleet-capture`'s.
"""


def _where(cls) -> str:
    return f"{cls.__module__.replace('.', '/')}.py: {cls.__name__}"


def _default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _show(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, Choice):
        return value.value
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "[" + ", ".join(_show(v) for v in value) + "]"
    # a default under the checkout (the demo traces) reads the same in every checkout
    return str(value).replace(str(ROOT) + "/", "<repo>/")


def _keys(cls, prefix: str):
    """(key, field, default) of every leaf field of ``cls``, nested sections flattened."""
    for f in dataclasses.fields(cls):
        value = _default(f)
        if dataclasses.is_dataclass(value):
            yield from _keys(type(value), f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", f, value


def _typed(key: str, f: dataclasses.Field, value) -> str:
    """A key as the group table shows it: choices spelled out."""
    if isinstance(value, Choice):
        return f"`{key}={'|'.join(c.value for c in type(value))}`"
    return f"`{key}`"


def _groups() -> list[tuple[str, type]]:
    """(group, dataclass): RunConfig's, then OTHER_GROUPS."""
    return [(f.name, type(_default(f))) for f in dataclasses.fields(RunConfig)] + OTHER_GROUPS


def _cell(text: str) -> str:
    return text.replace("|", chr(92) + "|")


def _table(title: str, cls, prefix: str) -> str:
    """A section: ``cls``'s docstring, then every leaf key under ``prefix`` with its help."""
    table = [f"## {title}", "", f"`{_where(cls)}`: {' '.join((cls.__doc__ or '').split())}", "",
             "| key | default | what it does |", "| --- | --- | --- |"]
    table += [f"| `{k}` | `{_cell(_show(v))}` | {_cell(help_of(f))} |"
              for k, f, v in _keys(cls, prefix)]
    return "\n".join(table)


def _predict_root_fields():
    """(class, field) of tracefleet-predict's root config: PredictConfig's, then those
    FitSearchRunConfig adds."""
    inherited = {f.name for f in dataclasses.fields(PredictConfig)}
    yield from ((PredictConfig, f) for f in dataclasses.fields(PredictConfig))
    yield from ((FitSearchRunConfig, f) for f in dataclasses.fields(FitSearchRunConfig)
                if f.name not in inherited)


def _root_rows(fields) -> list[str]:
    """A root config's top-level keys (sections shown as ``key.*``)."""
    rows = []
    for f in fields:
        nested = dataclasses.is_dataclass(_default(f))
        key, shown = (f"{f.name}.*", "") if nested else (f.name, f"`{_cell(_show(_default(f)))}`")
        rows.append(f"| `{key}` | {shown} | {_cell(help_of(f))} |")
    return rows


def _predict_root() -> str:
    """tracefleet-predict's root config."""
    return "\n".join(["## `tracefleet-predict`", "",
                      f"`{_where(PredictConfig)}`: {PredictConfig.__doc__.strip()} "
                      f"`experiment=fit_search` puts `{_where(FitSearchRunConfig)}` in its place "
                      "(`fit_search.*` added).", "",
                      "| key | default | what it does |", "| --- | --- | --- |",
                      *_root_rows(f for _, f in _predict_root_fields())])


def _capture_root() -> str:
    """tracefleet-capture's root config (its workload and cluster are the groups above)."""
    return "\n".join(["## `tracefleet-capture`", "",
                      f"`{_where(CaptureConfig)}`: {CaptureConfig.__doc__.strip()}", "",
                      "| key | default | what it does |", "| --- | --- | --- |",
                      *_root_rows(dataclasses.fields(CaptureConfig))])


def _capture_sections() -> list[tuple[str, type]]:
    """(name, dataclass) of tracefleet-capture's own sections (not the groups above)."""
    groups = {group for group, _ in _groups()}
    return [(f.name, type(_default(f))) for f in dataclasses.fields(CaptureConfig)
            if dataclasses.is_dataclass(_default(f)) and f.name not in groups]


def render() -> str:
    """The page, from the groups' dataclasses."""
    groups = _groups()
    rows, sections = [], []
    for group, cls in groups:
        options = sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml")
                         if p.stem not in NOT_RUN.get(group, ()))
        options += STORED_CHOICES.get(group, ())
        top = [f"`{group}.{f.name}.*`" if dataclasses.is_dataclass(_default(f))
               else _typed(f"{group}.{f.name}", f, _default(f)) for f in dataclasses.fields(cls)]
        rows.append(f"| `{group}` ({', '.join(f'`{o}`' for o in options)}) | `{_where(cls)}` | "
                    + ", ".join(top) + " |")
        sections.append(_table(f"`{group}`", cls, f"{group}."))
    sections.append(_predict_root())
    sections += [_table(f"`{name}` ({cli})", cls, f"{name}.")
                 for name, cls, cli in PREDICT_SECTIONS]
    sections.append(_capture_root())
    sections += [_table(f"`{name}` (tracefleet-capture)", cls, f"{name}.")
                 for name, cls in _capture_sections()]
    head = ["| group | dataclass | keys you will type |", "| --- | --- | --- |", *rows]
    return "\n\n".join([INTRO.rstrip("\n"), "\n".join(head), OUTRO.rstrip("\n"),
                        *sections]) + "\n"


def undocumented() -> list[str]:
    """Keys whose field has no help (the page would show a blank): the groups', then
    tracefleet-predict's root and its own sections'."""
    keyed = [(group, cls) for group, cls in _groups()]
    keyed += [(name, cls) for name, cls, _ in PREDICT_SECTIONS] + _capture_sections()
    missing = [k for group, cls in keyed for k, f, _ in _keys(cls, f"{group}.") if not help_of(f)]
    roots = [*_predict_root_fields(),
             *((CaptureConfig, f) for f in dataclasses.fields(CaptureConfig))]
    return missing + [f"{cls.__name__}.{f.name}" for cls, f in roots if not help_of(f)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when the page is stale")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        stale = DOC.read_text() != text
        if stale:
            print(f"{DOC} is stale: run python scripts/gen_config_docs.py", file=sys.stderr)
        return int(stale)
    DOC.write_text(text)
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
