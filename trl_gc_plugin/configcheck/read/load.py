"""Read a config file into a `Config`, or one `ConfigError` naming the file and line or key. YAML as the launchers
read it (PyYAML's safe loader), building only the keys some reader needs (`_split_top_level`: a 5 MB `datasets:` list
stays under a second); JSON with the standard library; an OpenRLHF or verl command line by the reader of commands the
caller passes (`launchers.parse_command`: this package imports no launcher reader).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
from collections.abc import Callable
from typing import Any

from .common import Config, ConfigError, NotTrainingConfig, short, type_name

MAX_BYTES = 64 * 1024 * 1024  # larger files are no configs: refused before being read


def read_text(path: str, what: str = "") -> str:
    """The file as UTF-8 text without a byte-order mark; `ConfigError` for anything else."""
    label = f"{what} {path}".strip()
    try:
        if os.path.isdir(path):
            raise ConfigError(f"{label}: is a directory, not a config file")
        size = os.path.getsize(path)
        if size > MAX_BYTES:
            raise ConfigError(f"{label}: {size} bytes; a config is at most {MAX_BYTES // (1024 * 1024)} MiB")
        with open(path, "rb") as fh:
            data = fh.read(MAX_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"{label}: cannot read: {exc.strerror or exc}") from None
    if data.startswith((b"\xff\xfe", b"\xfe\xff")) or b"\x00" in data:
        raise ConfigError(
            f"{label}: not a UTF-8 text file (it holds NUL bytes: binary, or UTF-16/UTF-32 text); "
            "save the config as UTF-8"
        )
    if data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise ConfigError(
            f"{label}: line {line}: not valid UTF-8 (byte {exc.start}); save the config as UTF-8"
        ) from None


def load(
    path: str, wanted: frozenset[str] | None = None, commands: Callable[[str, str], Config] | None = None
) -> Config:
    """The config at `path`, with the values of the top-level keys in `wanted` (all when None); a shell script or a
    command line is read by `commands(path, text)` (the launchers', `launchers.parse_command`)."""
    text = read_text(path)
    if not text.strip():
        raise ConfigError(f"{path}: the file is empty; a config is a mapping of keys")
    if path.lower().endswith(".json"):
        return _whole(path, _json(text, path), wanted, "json")
    if _is_command(path, text):
        if commands is None:
            raise ConfigError(f"{path}: a command line, and no reader of commands was given")
        return commands(path, text)
    _check_nesting(text, path)
    return _load_yaml(path, text, wanted)


def _is_command(path: str, text: str) -> bool:
    """A shell script (never YAML), or a text file that is not YAML holding an OpenRLHF or verl command line."""
    lower = path.lower()
    if lower.endswith((".sh", ".bash")):
        return True
    return ("openrlhf.cli." in text or "-m verl." in text) and (
        lower.endswith((".txt", ".cmd")) or not lower.endswith((".yaml", ".yml"))
    )


MAX_DEPTH = 1000
"""Deeper YAML is refused before libyaml reads it: its composer recurses in C (a crash, not an exception, at about
100,000 levels) and its parser slows down with depth. Configs nest a handful of levels."""

_BRACKETS = re.compile(r"[\[\]{}]")
_FLAT_PAIR = re.compile(r"\[[^\[\]{}]*\]|\{[^\[\]{}]*\}")
_COMPACT_SEQUENCES = re.compile(rf"(?:-[ \t]+){{{MAX_DEPTH // 2}}}")


def _check_nesting(text: str, path: str) -> None:
    """`ConfigError` when the YAML text may nest more than `MAX_DEPTH` levels: flow brackets (counted, inside strings
    too), indentation, or compact `- - -` sequences."""

    def refuse(offset: int) -> None:
        line = text.count("\n", 0, offset) + 1
        raise ConfigError(f"{path}: line {line}: nested more than {MAX_DEPTH} levels deep; a config nests a few levels")

    if text.count("[") + text.count("{") > MAX_DEPTH:
        reduced = text
        for _ in range(3):  # drop innermost bracket pairs: `train[:10%]` a thousand times is not deep
            smaller = _FLAT_PAIR.sub("", reduced)
            if len(smaller) == len(reduced):
                break
            reduced = smaller
        if reduced.count("[") + reduced.count("{") > MAX_DEPTH:
            depth = 0
            for match in _BRACKETS.finditer(text):
                if match.group() in "[{":
                    depth += 1
                    if depth > MAX_DEPTH:
                        refuse(match.start())
                elif depth:
                    depth -= 1
    deep = ("\n" + text).find("\n" + " " * MAX_DEPTH)  # at the start of a line
    if deep != -1:
        refuse(deep)
    if "- -" in text or "-\t" in text:
        found = _COMPACT_SEQUENCES.search(text)
        if found is not None:
            refuse(found.start())


def _json(text: str, label: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{label}: line {exc.lineno}, column {exc.colno}: {exc.msg}") from None
    except (ValueError, RecursionError) as exc:  # integers over the digit limit, nesting too deep
        raise ConfigError(f"{label}: cannot read: {type(exc).__name__}: {short(str(exc), 120)}") from None


def load_json_file(path: str, what: str) -> Any:
    """A JSON file another config names (a DeepSpeed or FSDP config)."""
    return _json(read_text(path, what), f"{what} {path}")


def load_yaml_file(path: str, what: str) -> Any:
    """A YAML file another config names (an accelerate config)."""
    import yaml

    text = read_text(path, what)
    try:
        return yaml.load(text, Loader=_loader_class())
    except yaml.YAMLError as exc:
        raise ConfigError(f"{what} {path}: {_yaml_message(exc, text)}") from None
    except (ValueError, TypeError, OverflowError, RecursionError) as exc:
        raise ConfigError(f"{what} {path}: cannot read: {type(exc).__name__}: {short(str(exc), 120)}") from None


def _whole(path: str, data: Any, wanted: frozenset[str] | None, kind: str) -> Config:
    if not isinstance(data, dict):
        raise NotTrainingConfig(f"{path}: the top level must be a mapping of keys, not {type_name(data)}") from None
    values = data if wanted is None else {k: v for k, v in data.items() if k in wanted}
    return Config(path=path, values=values, keys=tuple(data), kind=kind)


def _loader_class() -> Any:
    import yaml

    return getattr(yaml, "CSafeLoader", None) or yaml.SafeLoader


def _yaml_message(exc: Any, text: str = "") -> str:
    mark = getattr(exc, "problem_mark", None)
    if mark is None and isinstance(getattr(exc, "position", None), int):  # a ReaderError: a character YAML refuses
        line = text.count("\n", 0, exc.position) + 1 if text else None
        character = getattr(exc, "character", "")
        code = f"#x{ord(character):04x}" if isinstance(character, str) and len(character) == 1 else repr(character)
        return (f"line {line}: " if line else "") + f"character {code}: {getattr(exc, 'reason', 'not allowed')}"
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    problem = getattr(exc, "problem", None) or str(exc)
    context = getattr(exc, "context", None)
    message = f"{where}{problem}" + (f" ({context})" if context and context != problem else "")
    return " ".join(message.split())


class _WholeDocument(Exception):
    """The fast path cannot split this document faithfully: read it whole."""


_DOCUMENT_MARK = re.compile(r"(---|\.\.\.)(?:[ \t].*)?\r?$|%.*$")
_PLAIN_KEY = re.compile(r"([A-Za-z_][A-Za-z0-9_.\-/]*)[ \t]*:(?:[ \t]|\r?$)")
_TOP_LINE = re.compile(r"^[^ \t\r\n#].*$", re.MULTILINE)
MAX_TOP_LEVEL_KEYS = 5000


def _load_yaml(path: str, text: str, wanted: frozenset[str] | None) -> Config:
    import yaml

    try:
        if wanted is not None:
            with contextlib.suppress(_WholeDocument):
                return Config(path, *_split_top_level(text, wanted))
        data = yaml.load(text, Loader=_loader_class())
        if data is None:
            raise ConfigError(f"{path}: the file holds no keys (empty, or only comments)")
        for key in data if isinstance(data, dict) else ():
            if not isinstance(key, str):
                raise NotTrainingConfig(f"{path}: top-level key {short(key)} is not a string")
        return _whole(path, data, wanted, "yaml")
    except ConfigError:
        raise
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: {_yaml_message(exc, text)}") from None
    except RecursionError:
        raise ConfigError(f"{path}: nested too deeply to read") from None
    except (ValueError, TypeError, OverflowError) as exc:  # e.g. an integer over the digit limit, a bad date
        raise ConfigError(f"{path}: cannot read a value: {type(exc).__name__}: {short(str(exc), 120)}") from None


def _split_top_level(text: str, wanted: frozenset[str]) -> tuple[dict[str, Any], tuple[str, ...], dict[str, int]]:
    """The fast path for a block mapping at column 0 (every launcher's config); anything unusual (flow or list top
    level, document markers after the start, complex, quoted or merge keys, an alias into another part, no C parser)
    raises `_WholeDocument`."""
    import yaml

    loader = getattr(yaml, "CSafeLoader", None)
    if loader is None:
        raise _WholeDocument
    starts: list[tuple[int, str]] = []  # (offset, key)
    for match in _TOP_LINE.finditer(text):
        line_text = match.group(0)
        if _DOCUMENT_MARK.match(line_text):
            if starts:
                raise _WholeDocument  # a document marker after the first key: several documents, or an odd file
            continue
        key_match = _PLAIN_KEY.match(line_text)
        if key_match is None:
            raise _WholeDocument  # a quoted or complex key, a top-level list or flow mapping, a continuation line
        starts.append((match.start(), key_match.group(1)))
        if len(starts) > MAX_TOP_LEVEL_KEYS:
            raise _WholeDocument
    if not starts:
        raise _WholeDocument
    resolver = _resolver()
    values: dict[str, Any] = {}
    keys: dict[str, None] = {}
    lines: dict[str, int] = {}
    line, last = 1, 0
    for i, (offset, key) in enumerate(starts):
        line += text.count("\n", last, offset)
        last = offset
        end = starts[i + 1][0] if i + 1 < len(starts) else len(text)
        part = text[offset:end]
        if resolver(key) != "tag:yaml.org,2002:str" or key == "<<":
            raise _WholeDocument  # `true:`, `1:`, `null:`, a merge: the full loader says what the key is
        if key in wanted:
            try:
                data = yaml.load(part, Loader=loader)
            except yaml.YAMLError:
                raise _WholeDocument from None  # an alias into another part, or a real error: the full loader tells
            if not isinstance(data, dict) or list(data) != [key]:
                raise _WholeDocument
            values[key] = data[key]
        else:
            try:
                loader(part).raw_parse()
            except yaml.YAMLError:
                raise _WholeDocument from None  # the full loader reports it with the file's own line numbers
        keys.pop(key, None)  # a repeated key: the last one wins, as in a full load
        keys[key] = None
        lines[key] = line
    return values, tuple(keys), lines


@functools.lru_cache(maxsize=1)
def _resolver() -> Any:
    """The implicit tag a plain scalar resolves to under YAML 1.1 (PyYAML's resolver)."""
    from yaml.nodes import ScalarNode
    from yaml.resolver import Resolver

    return functools.partial(Resolver().resolve, ScalarNode, implicit=(True, False))
