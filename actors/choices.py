"""Closed sets of config values: a ``str`` Enum, so Hydra refuses a typo at compose time
and the rest of the code compares members with plain strings (``mode == "lazy"``)."""
from __future__ import annotations

from enum import Enum

from actors.errors import ConfigError


class Choice(str, Enum):
    """Base of every choice in the configs; ``str(member)`` is its value."""

    def __str__(self) -> str:
        return self.value

    @classmethod
    def coerce(cls, value, key: str) -> "Choice":
        """``value`` as a member of ``cls`` (dataclasses built in code bypass OmegaConf's
        check); ConfigError naming ``key`` and the allowed values otherwise."""
        try:
            return cls(value)
        except ValueError:
            allowed = ", ".join(m.value for m in cls)
            raise ConfigError(f"{key}={value!r}; expected one of {allowed}") from None
