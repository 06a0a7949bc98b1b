"""Config fields that carry their help: ``setting(default, help="...")`` is
``dataclasses.field`` with ``metadata={"help": ...}``, so a tool can read what a field means
(scripts/gen_config_docs.py writes docs/configuration.md from it; tests/test_config_docs.py
fails when the page and the dataclasses drift apart).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

from actors.errors import ConfigError

HELP = "help"  # the metadata key


def setting(default: Any = dataclasses.MISSING, *, help: str,
            factory: Any = dataclasses.MISSING) -> Any:
    """A dataclass field with ``default`` (or ``factory()`` per instance) and its ``help``."""
    if not help:
        raise ValueError("a config field needs its help text")
    if factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=factory, metadata={HELP: help})
    return dataclasses.field(default=default, metadata={HELP: help})


def help_of(f: dataclasses.Field) -> str:
    """The help of a dataclass field ("" when it has none)."""
    return f.metadata.get(HELP, "")


def check_finite(cfg: Any, prefix: str = "") -> None:
    """ConfigError naming the key of the first float field under the dataclass ``cfg`` that is
    nan or infinite (a timeout, a fraction, a threshold): refused where it enters, before it
    reaches a clock or a comparison that nan always fails."""
    for f in dataclasses.fields(cfg):
        value, key = getattr(cfg, f.name), f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            check_finite(value, f"{key}.")
        elif isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{key}={value}: expected a finite number")
