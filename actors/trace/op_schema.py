"""Parse ATen operator schema strings as recorded in Execution Traces (torch-free).

A schema reads ``ns::name.overload(args) -> returns``, e.g.
``aten::add.Tensor(Tensor self, Tensor other, *, Scalar alpha=1) -> Tensor``. Arguments are
``type[(alias)] name[=default]``; ``*`` makes the following ones keyword-only; ``...`` marks
varargs/varrets. Alias annotations (``Tensor(a!)``, ``Tensor(a -> *)``, ``t[](a!)``) are
stripped from the type and kept as text. Trace text is tokenized by hand, never evaluated.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from actors.errors import ReplayError

# A "(" after these names opens type parameters, not an alias annotation.
_TYPE_CONSTRUCTORS = frozenset({"Dict", "Future", "RRef", "Await", "Union", "Optional",
                                "Tuple", "List"})
_OPEN, _CLOSE = "([{", ")]}"


@dataclass(frozen=True, slots=True)
class SchemaArg:
    """One argument. ``type`` excludes the alias annotation; ``alias`` is its text (``"a!"``)."""

    name: str
    type: str
    kwarg_only: bool
    has_default: bool
    alias: str | None
    is_write: bool
    default: str | None = None  # the default's source text, e.g. "1", "[]", "None"


@dataclass(frozen=True, slots=True)
class SchemaReturn:
    """One return value; ``name`` is "" unless the schema names it."""

    type: str
    alias: str | None
    is_write: bool
    name: str = ""


@dataclass(frozen=True, slots=True)
class OpSchema:
    """A parsed schema; ``overload`` is "" for the default overload."""

    namespace: str
    name: str
    overload: str
    args: tuple[SchemaArg, ...]
    returns: tuple[SchemaReturn, ...]
    is_vararg: bool = False
    is_varret: bool = False

    @property
    def qualified_name(self) -> str:
        """``ns::name`` without the overload."""
        return f"{self.namespace}::{self.name}" if self.namespace else self.name


class _Malformed(Exception):
    """Internal: the text does not follow the schema grammar."""


@lru_cache(maxsize=8192)
def parse_schema(text: str) -> OpSchema:
    """Parse one schema string; raise ReplayError naming the text when it is malformed."""
    try:
        return _parse(text.strip())
    except _Malformed as e:
        raise ReplayError(f"malformed op schema {text!r}: {e}") from None


@lru_cache(maxsize=8192)
def fresh_return_positions(schema_str: str) -> tuple[bool, ...]:
    """Per return: True when it is a newly allocated tensor (a Tensor type without alias).

    Never raises: an empty or unparsable schema gives ``()``.
    """
    if not isinstance(schema_str, str) or not schema_str:
        return ()
    try:
        schema = _parse(schema_str.strip())
    except _Malformed:
        return ()
    return tuple(r.alias is None and r.type.startswith("Tensor") for r in schema.returns)


def is_view_op(schema_str: str) -> bool:
    """Whether an op only makes views of its inputs: every return aliases an input and
    nothing is written (``aten::narrow(Tensor(a) self, ...) -> Tensor(a)``); such an op
    reads no data. False for an empty or unparsable schema."""
    if not isinstance(schema_str, str) or not schema_str:
        return False
    try:
        schema = _parse(schema_str.strip())
    except _Malformed:
        return False
    returns = [r for r in schema.returns if r.type.startswith("Tensor")]
    return bool(returns) and all(r.alias is not None and not r.is_write for r in returns) \
        and not any(a.is_write for a in schema.args)


def _parse(s: str) -> OpSchema:
    open_at = s.find("(")
    if open_at <= 0:
        raise _Malformed("expected 'ns::name(' at the start")
    namespace, name, overload = _split_name(s[:open_at].strip())
    close_at = _matching(s, open_at)
    tail = s[close_at + 1:].strip()
    if not tail.startswith("->"):
        raise _Malformed("expected '->' after the argument list")
    args, is_vararg = _parse_args(s[open_at + 1:close_at])
    returns, is_varret = _parse_returns(tail[2:].strip())
    return OpSchema(namespace, name, overload, args, returns, is_vararg, is_varret)


def _split_name(head: str) -> tuple[str, str, str]:
    namespace, _, rest = head.rpartition("::")
    name, _, overload = rest.partition(".")
    if not _is_identifier(name) or (namespace and not _is_identifier(namespace)) \
            or (overload and not _is_identifier(overload)):
        raise _Malformed(f"bad operator name {head!r}")
    return namespace, name, overload


def _is_identifier(text: str) -> bool:
    return bool(text) and text.replace("_", "a").isalnum()


def _scan(s: str, start: int = 0):
    """Yield (index, char, bracket depth after it) for each character outside quotes."""
    depth, i = 0, start
    while i < len(s):
        ch = s[i]
        if ch in "\"'":
            i = _skip_quoted(s, i)
            continue
        if ch in _OPEN:
            depth += 1
        elif ch in _CLOSE:
            depth -= 1
        yield i, ch, depth
        i += 1


def _matching(s: str, open_at: int) -> int:
    """Index of the bracket closing the one at ``open_at``, skipping quoted text."""
    for i, ch, depth in _scan(s, open_at):
        if depth <= 0 and ch in _CLOSE:
            if depth == 0:
                return i
            break
    raise _Malformed(f"unbalanced bracket opened at offset {open_at}")


def _skip_quoted(s: str, i: int) -> int:
    """Index just past the string literal starting at ``i``."""
    quote, i = s[i], i + 1
    while i < len(s):
        if s[i] == "\\":
            i += 2
        elif s[i] == quote:
            return i + 1
        else:
            i += 1
    raise _Malformed("unterminated string literal")


def _top_level(s: str):
    """Yield (index, char) for each character outside brackets and quotes."""
    depth = 0
    for i, ch, depth in _scan(s):
        if depth < 0:
            raise _Malformed(f"unbalanced {ch!r} in {s!r}")
        if depth == 0 and ch not in _CLOSE:
            yield i, ch
    if depth != 0:
        raise _Malformed(f"unbalanced brackets in {s!r}")


def _split_top(s: str, sep: str) -> list[str]:
    """Split at top-level ``sep`` characters (``sep`` " " means any whitespace)."""
    parts, start = [], 0
    for i, ch in _top_level(s):
        if ch == sep or (sep == " " and ch.isspace()):
            parts.append(s[start:i])
            start = i + 1
    parts.append(s[start:])
    return parts


def _parse_args(text: str) -> tuple[tuple[SchemaArg, ...], bool]:
    if not text.strip():
        return (), False
    args, kwarg_only, is_vararg = [], False, False
    for piece in (p.strip() for p in _split_top(text, ",")):
        if piece == "*":
            kwarg_only = True
        elif piece == "...":
            is_vararg = True
        elif not piece or is_vararg:
            raise _Malformed("empty argument or argument after '...'")
        else:
            args.append(_parse_arg(piece, kwarg_only))
    return tuple(args), is_vararg


def _parse_arg(piece: str, kwarg_only: bool) -> SchemaArg:
    eq = next((i for i, ch in _top_level(piece) if ch == "="), -1)
    decl, default = (piece, None) if eq < 0 else (piece[:eq], piece[eq + 1:].strip())
    words = [w for w in _split_top(decl.strip(), " ") if w]
    if len(words) != 2:
        raise _Malformed(f"expected 'type name' in argument {piece!r}")
    if default == "":
        raise _Malformed(f"empty default in argument {piece!r}")
    type_text, alias = _strip_alias(words[0])
    return SchemaArg(words[1], type_text, kwarg_only, default is not None, alias,
                     alias is not None and "!" in alias, default)


def _parse_returns(text: str) -> tuple[tuple[SchemaReturn, ...], bool]:
    if text == "...":
        return (), True
    if not text:
        raise _Malformed("missing return type")
    if text[0] == "(" and _matching(text, 0) == len(text) - 1:
        inner = text[1:-1].strip()
        pieces = [p.strip() for p in _split_top(inner, ",")] if inner else []
    else:
        pieces = [text]
    returns = []
    for piece in pieces:
        words = [w for w in _split_top(piece, " ") if w]
        if not words or len(words) > 2:
            raise _Malformed(f"bad return {piece!r}")
        type_text, alias = _strip_alias(words[0])
        returns.append(SchemaReturn(type_text, alias, alias is not None and "!" in alias,
                                    words[1] if len(words) == 2 else ""))
    return tuple(returns), False


def _strip_alias(type_text: str) -> tuple[str, str | None]:
    """Remove top-level alias annotations from a type; return (type, first alias text)."""
    if not type_text:
        raise _Malformed("empty type")
    out, alias, i = [], None, 0
    while i < len(type_text):
        ch = type_text[i]
        if ch == "(":
            end = _matching(type_text, i)
            prefix = "".join(out)
            word = prefix[len(prefix.rstrip("abcdefghijklmnopqrstuvwxyz"
                                            "ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.")):]
            if i == 0 or word in _TYPE_CONSTRUCTORS:  # a tuple type or type parameters
                out.append(type_text[i:end + 1])
            elif alias is None:
                alias = type_text[i + 1:end].strip()
            i = end + 1
        else:
            out.append(ch)
            i += 1
    return "".join(out), alias
