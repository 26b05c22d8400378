"""The fleet programs' YAML files read into typed configurations, one way for all of them.

Each program describes its file as msgspec Structs (``frozen=True, kw_only=True``; bounds as
``msgspec.Meta``; ``forbid_unknown_fields=True`` where an unknown key is an error) and reads
it with :func:`config_convert`, strictly: no ``"1"`` for 1, no ``true`` for 1. A wrong type,
a missing or unknown key, a value out of its bounds or not among its choices is a
:class:`ConfigError` whose message starts with the key path (``engines[0].port: expected int,
got str``), so that an operator can find the line. What no type can say (one key against
another) is plain code in a Struct's ``__post_init__``: msgspec puts the path of the Struct in
front of its message (a message that starts with ``.`` names a key below that Struct:
``.endpoint: ...``). Secrets come from the environment (:func:`env_secret`), after the
conversion.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Any, TypeVar

import msgspec
import msgspec.inspect as mi
import yaml

T = TypeVar("T")

_HTTP = r"^https?://"
_HTTP_OR_EMPTY = r"^(https?://|$)"
_ZMQ = r"^(tcp|ipc|inproc)://"
HttpUrl = Annotated[str, msgspec.Meta(pattern=_HTTP)]
HttpUrlOrEmpty = Annotated[str, msgspec.Meta(pattern=_HTTP_OR_EMPTY)]
ZmqEndpoint = Annotated[str, msgspec.Meta(pattern=_ZMQ)]
Name = Annotated[str, msgspec.Meta(min_length=1)]
Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]
# What a value that does not match a pattern above is told.
_PATTERNS = {
    _HTTP: "must start with http:// or https://",
    _HTTP_OR_EMPTY: "must start with http:// or https:// (or be empty)",
    _ZMQ: "a ZMQ endpoint (tcp://host:port)",
}
# msgspec's names of the types, as a YAML file says them.
_WORDS = {"object": "mapping", "array": "list"}
# msgspec's ValidationError: "<what> - at `$<path>`", or "... - at `key` in `$<path>`".
_ERROR = re.compile(r"(?P<what>.*?)(?: - at (?P<key>`key` in )?`\$(?P<path>[^`]*)`)?", re.S)
_FIELD = re.compile(r"Object (missing required|contains unknown) field `([^`]*)`")


class ConfigError(ValueError):
    """A configuration that cannot be used; the message starts with the key path."""


def config_convert(raw: Any, type_: type[T], *, null_is_default: bool = False) -> T:
    """``raw`` (a YAML document) as ``type_``; :class:`ConfigError` naming the key.
    ``null_is_default``: a key given as null counts as left out."""
    if null_is_default:
        raw = _without_nulls(raw)
    try:
        return msgspec.convert(raw, type=type_, strict=True)
    except msgspec.ValidationError as exc:
        raise ConfigError(_message(str(exc), type_)) from None


def config_file_read(path: str | Path) -> Any:
    """The YAML document in ``path``; :class:`ConfigError` when unreadable or not YAML (the
    caller names the file)."""
    try:
        return yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"not YAML: {exc}") from None


def config_or_exit(load: Callable[[Path], T], path: Path, program: str) -> T:
    """``load(path)``; a :class:`ConfigError` is printed, with the program and the file, and
    the program exits with status 2 (what every fleet program does with a bad file)."""
    try:
        return load(path)
    except ConfigError as exc:
        print(f"{program}: {path}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def env_secret(given: str, variable: str, key: str, env: Mapping[str, str]) -> str:
    """``given`` when the file holds it, else the environment ``variable`` (named by ``key``)."""
    value = given or env.get(variable, "")
    if not value:
        raise ConfigError(f"{key}: environment variable {variable} is not set")
    return value


def _without_nulls(raw: Any) -> Any:
    if isinstance(raw, Mapping):
        return {k: _without_nulls(v) for k, v in raw.items() if v is not None}
    if isinstance(raw, list):
        return [_without_nulls(v) for v in raw]
    return raw


def _message(error: str, type_: Any) -> str:
    match = _ERROR.fullmatch(error)
    assert match is not None  # every string matches: the location is optional
    what, path, in_key = match["what"], match["path"] or "", bool(match["key"])
    field = _FIELD.match(what)
    if field:
        what = f".{field[2]}: " + ("required" if field[1].startswith("missing") else "unknown key")
    elif what.startswith("Invalid enum value "):
        choices = _choices(type_, path, in_key)
        value = what[len("Invalid enum value ") :]
        what = f"must be {choices}, got {value}" if choices else f"{value} is not allowed"
    elif what.startswith("Expected "):
        pattern = re.search(r"matching regex '(.*)'$", what)
        what = _PATTERNS.get(pattern[1], what) if pattern else what
        what = re.sub(r"`([^`]*)`", lambda w: _words(w[1]), what[0].lower() + what[1:])
    where = (path + " key" if in_key else path).lstrip(".")
    if what.startswith("."):
        return (path + what).lstrip(".")
    return f"{where or 'config'}: {what}"


def _words(kinds: str) -> str:
    """msgspec's ``object | null`` as ``mapping or null``."""
    return " or ".join(_WORDS.get(kind, kind) for kind in kinds.split(" | "))


def _choices(type_: Any, path: str, in_key: bool) -> str | None:
    """The values a Literal or an enum at ``path`` of ``type_`` allows, as text."""
    info = _bare(mi.type_info(type_))
    for name in re.findall(r"\.([^.\[]+)|\[[^\]]*\]", path):
        if name and isinstance(info, mi.StructType):
            found = [f.type for f in info.fields if f.encode_name == name]
            if not found:
                return None
            info = found[0]
        elif isinstance(info, mi.DictType):
            info = info.value_type
        elif isinstance(info, mi.ListType | mi.VarTupleType):
            info = info.item_type
        else:
            return None
        info = _bare(info)
    if in_key and isinstance(info, mi.DictType):
        info = _bare(info.key_type)
    if isinstance(info, mi.EnumType):
        return " or ".join(sorted(str(m.value) for m in info.cls))
    return " or ".join(map(str, info.values)) if isinstance(info, mi.LiteralType) else None


def _bare(info: mi.Type) -> mi.Type:
    """``info`` without its metadata, and without None when it is optional."""
    while isinstance(info, mi.Metadata | mi.UnionType):
        if isinstance(info, mi.Metadata):
            info = info.type
        else:
            kinds = [t for t in info.types if not isinstance(t, mi.NoneType)]
            if len(kinds) != 1:
                break
            info = kinds[0]
    return info
