"""A shell script's command, read as bash would expand it, statically: never run.

Variables, arrays, heredocs, `bash -c` payloads and the assignments of sourced files are expanded; what a static
reading cannot know (the environment, a command's output, a variable set in a loop or function, arithmetic) becomes
a placeholder word naming it, so a caller can say which flags it could not read instead of reading them as absent.
"""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass, field

from .common import find_beside

PLACEHOLDER = "\x00unresolved{}\x00"
_PLACEHOLDER = re.compile("\x00unresolved(\\d+)\x00")

_ASSIGN = re.compile(r"^(?:export\s+|local\s+|readonly\s+|declare\s+(?:-\w+\s+)*)?([A-Za-z_]\w*)(\+?)=(.*)$", re.S)
_BLOCK_OPEN = re.compile(r"^(for|while|until|select|if|case)\b|^[A-Za-z_][\w-]*\s*\(\)\s*\{?\s*$|^function\s+\w+")
_BLOCK_CLOSE = re.compile(r"^(?:done|fi|esac|\})(?:[\s;&|)]|$)")
_CLOSES_ITSELF = re.compile(r"(?:^|[\s;])(?:done|fi|esac|\})\s*;?\s*$")
_HEREDOC = re.compile(r"<<(-?)\s*(['\"]?)([A-Za-z_]\w*)\2")
_READ_INTO = re.compile(r"^read\b.*?\s([A-Za-z_]\w*)\s*<<")
_PRINTS = frozenset({"echo", "printf", "cat", "logger", ":", "tee"})
_SOURCE = re.compile(r"^(?:source|\.)\s+(\S+)")
_EXPANSION = re.compile(
    r"\"\$\{(?P<qarray>[A-Za-z_]\w*)\[@\]\}\"|\"\$(?P<qargs>@)\""
    r"|\$\(\((?P<arith>.*?)\)\)"
    r"|\$\((?P<subst>[^()]*(?:\([^()]*\)[^()]*)*)\)"
    r"|`(?P<tick>[^`]*)`"
    r"|\$\{(?P<braced>[^}]*)\}"
    r"|\$(?P<plain>[A-Za-z_]\w*|[0-9@*#?$!-])",
    re.S,
)


@dataclass
class Expanded:
    """A command's words; `unresolved[i]` says what placeholder i stands for; `many` holds the placeholders that may
    stand for several words (flags may hide there)."""

    words: list[str]
    unresolved: list[str] = field(default_factory=list)
    many: frozenset[int] = frozenset()
    alternatives: dict[int, list[list[str]]] = field(default_factory=dict)
    """For a placeholder of a variable set inside a block: the words of each value the script gives it (the one
    before the block, then each inside it), one of which it holds when the command runs."""

    def what(self, word: str) -> list[str]:
        """What the placeholders inside `word` stand for (empty: the word was read whole)."""
        return [self.unresolved[int(m.group(1))] for m in _PLACEHOLDER.finditer(word)]

    def hides_words(self, word: str, after_a_value: bool = False) -> bool:
        """`word` is a placeholder alone that may stand for several words (any placeholder alone `after_a_value`: a
        flag takes one value, so a second word there is an unquoted variable bash splits into words, flags maybe)."""
        match = _PLACEHOLDER.fullmatch(word)
        return match is not None and (after_a_value or int(match.group(1)) in self.many)


@dataclass
class _Scope:
    scalars: dict[str, str] = field(default_factory=dict)
    arrays: dict[str, list[str]] = field(default_factory=dict)
    unknown: dict[str, str] = field(default_factory=dict)  # name -> why it cannot be known
    unresolved: list[str] = field(default_factory=list)
    many: set[int] = field(default_factory=set)
    missing_sources: list[str] = field(default_factory=list)
    branches: dict[str, list[list[str]]] = field(default_factory=dict)  # name -> the words of each value given
    alternatives: dict[int, list[list[str]]] = field(default_factory=dict)

    def placeholder(self, what: str, many: bool = False, name: str = "") -> str:
        self.unresolved.append(what)
        if many:
            self.many.add(len(self.unresolved) - 1)
        if name in self.branches:
            self.alternatives[len(self.unresolved) - 1] = [list(w) for w in self.branches[name]]
        return PLACEHOLDER.format(len(self.unresolved) - 1)

    def expand(self, text: str) -> str:
        """`text` with every expansion replaced by its value (array elements quoted as words) or a placeholder."""

        def one(match: re.Match[str]) -> str:
            if match.group("qarray") is not None:  # "${ARGS[@]}": one word per element, as unquoted
                return self._braced(match.group("qarray") + "[@]", match.group(0))
            if match.group("qargs") is not None:
                return self._variable("@", match.group(0))
            if match.group("arith") is not None:
                return self.placeholder(f"$(({match.group('arith').strip()})): arithmetic is not evaluated")
            if match.group("subst") is not None or match.group("tick") is not None:
                body = (match.group("subst") or match.group("tick") or "").strip()
                return self.placeholder(f"$({body}): a command's output, known only when the script runs", many=True)
            if match.group("plain") is not None:
                return self._variable(match.group("plain"), match.group(0))
            return self._braced(match.group("braced"), match.group(0))

        return _EXPANSION.sub(one, text)

    def _braced(self, inner: str, spelled: str) -> str:
        array = re.fullmatch(r"([A-Za-z_]\w*)\[(@|\*)\]", inner)
        if array:
            name = array.group(1)
            if name in self.arrays:
                # an element that is a placeholder alone stays unquoted (it may stand for several words)
                return " ".join(w if _PLACEHOLDER.fullmatch(w) else shlex.quote(w) for w in self.arrays[name])
            if name in self.scalars:
                return self.scalars[name]
            return self.placeholder(
                f"{spelled}: {self.unknown.get(name, 'an array the script does not set')}", many=True, name=name
            )
        element = re.fullmatch(r"([A-Za-z_]\w*)\[(\d+)\]", inner)
        if element and element.group(1) in self.arrays:
            items = self.arrays[element.group(1)]
            index = int(element.group(2))
            return shlex.quote(items[index]) if index < len(items) else ""
        default = re.fullmatch(r"([A-Za-z_]\w*):?[-=](.*)", inner, re.S)
        if default:
            name = default.group(1)
            if name in self.scalars or name in self.arrays:
                return self._variable(name, spelled)
            if name in self.unknown:
                return self.placeholder(f"{spelled}: {self.unknown[name]}", name=name)
            return self.expand(default.group(2))
        if re.fullmatch(r"[A-Za-z_]\w*", inner):
            return self._variable(inner, spelled)
        return self.placeholder(f"{spelled}: this expansion is not evaluated")

    def _variable(self, name: str, spelled: str) -> str:
        if name in self.scalars:
            return self.scalars[name]
        if name in self.arrays:
            return self.arrays[name][0] if self.arrays[name] else ""
        why = "a script argument" if name.isdigit() or name in "@*#" else "not set in the script (the environment's)"
        return self.placeholder(f"{spelled}: {self.unknown.get(name, why)}", many=name in "@*", name=name)

    def words(self, text: str) -> list[str]:
        try:
            return shlex.split(self.expand(text), comments=True)
        except ValueError:
            return self.expand(text).split()


def _statements(text: str) -> list[str]:
    """Logical lines: continuations joined, and an array assignment or a heredoc kept as one statement."""
    lines = re.sub(r"\\\r?\n", " ", text).splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        stripped = lines[i].strip()
        heredoc = _HEREDOC.search(stripped) if not stripped.startswith("#") else None
        assign = _ASSIGN.match(stripped)
        if heredoc:  # up to the line that ends it
            end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == heredoc.group(3)), len(lines))
            out.append(stripped + "\n" + "\n".join(lines[i + 1 : end]))
            i = end + 1
        elif assign and assign.group(3).lstrip().startswith("(") and not _closed(assign.group(3)):
            value = assign.group(3)  # an array, up to the line that closes it
            ends = (j for j in range(i + 1, len(lines)) if _closed("\n".join([value, *lines[i + 1 : j + 1]])))
            end = next(ends, len(lines) - 1)
            out.append("\n".join([stripped, *lines[i + 1 : end + 1]]))
            i = end + 1
        elif assign and _quote_open(assign.group(3)):  # `X="` ... `"`: a quoted value over several lines
            ends = (
                j
                for j in range(i + 1, len(lines))
                if not _quote_open("\n".join([assign.group(3), *lines[i + 1 : j + 1]]))
            )
            end = next(ends, len(lines) - 1)
            out.append("\n".join([stripped, *lines[i + 1 : end + 1]]))
            i = end + 1
        else:
            out.append(stripped)
            i += 1
    return out


def _quote_open(value: str) -> bool:
    """Whether `value` ends inside a quoted string (a `#` outside quotes ends the line's words)."""
    quote = ""
    i = 0
    while i < len(value):
        ch = value[i]
        if quote:
            if ch == "\\" and quote == '"':
                i += 1
            elif ch == quote:
                quote = ""
        elif ch == "\\":
            i += 1
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or value[i - 1].isspace()):
            nl = value.find("\n", i)
            if nl == -1:
                return False
            i = nl
        i += 1
    return bool(quote)


def _closed(value: str) -> bool:
    """Whether an array's `( ... )` is closed (parentheses outside quotes and comments balance)."""
    depth, quote = 0, ""
    for line in value.splitlines():
        for ch in line:
            if quote:
                quote = "" if ch == quote else quote
            elif ch in "'\"":
                quote = ch
            elif ch == "#":
                break
            elif ch == "(":
                depth += 1
            elif ch == ")":
                depth -= 1
    return depth <= 0


def _assign(scope: _Scope, statement: str, in_block: bool) -> bool:
    """Apply an assignment statement to `scope`; False when `statement` is not one."""
    match = _ASSIGN.match(statement)
    if match is None:
        return False
    name, append, value = match.group(1), match.group(2), match.group(3)
    rest = "" if value.lstrip().startswith("(") else _after_first_word(value)
    if rest.lstrip(";&| \t").strip():  # more than one word: `A=1 B=2`, or `NAME=value command ...` (an environment
        tail = rest.lstrip(";&| \t").strip()  # for one command), or `NAME=value; command ...`
        if not _ASSIGN.match(tail):
            return False
        _assign(scope, statement[: len(statement) - len(rest)], in_block)
        return _assign(scope, tail, in_block)
    if in_block:
        before = scope.arrays.get(name, [scope.scalars[name]] if name in scope.scalars else None)
        if name not in scope.unknown:
            scope.branches[name] = [] if before is None else [before]
        if name in scope.branches:  # `+=` adds to the value before the block (in a loop: the words it may hold)
            value = value.strip()
            body = value[1 : value.rfind(")")] if value.startswith("(") and ")" in value else value
            words = scope.words(body) if value.startswith("(") else " ".join(scope.words(value)).split()
            base = scope.branches[name][0] if append and scope.branches[name] else []
            scope.branches[name].append(base + words)
        scope.unknown[name] = "set inside a loop, a branch or a function"
        scope.scalars.pop(name, None)
        scope.arrays.pop(name, None)
        return True
    value = value.strip()
    if value.startswith("("):
        body = value[1 : value.rfind(")")] if ")" in value else value[1:]
        words = scope.words(body)
        scope.arrays[name] = (scope.arrays.get(name, []) if append else []) + words
        scope.scalars.pop(name, None)
        scope.branches.pop(name, None)
        return True
    words = scope.words(value) if value else [""]
    text = " ".join(words) if len(words) != 1 else words[0]
    scope.scalars[name] = (scope.scalars.get(name, "") if append else "") + text
    scope.arrays.pop(name, None)
    scope.unknown.pop(name, None)
    scope.branches.pop(name, None)
    return True


def _after_first_word(value: str) -> str:
    """What follows the first shell word of `value` (quotes, `$(...)`, `${...}` kept in it); "" if only a comment."""
    depth, quote, i = 0, "", 0
    while i < len(value):
        ch = value[i]
        if quote:
            if ch == quote:
                quote = ""
            elif ch == "\\" and quote == '"':
                i += 1
        elif ch == "\\":
            i += 1
        elif ch in "'\"`":
            quote = ch
        elif ch == "$" and value[i + 1 : i + 2] in ("(", "{"):
            depth += 1
            i += 1
        elif depth and ch in "({":
            depth += 1
        elif depth and ch in ")}":
            depth -= 1
        elif not depth and (ch.isspace() or ch in ";&|"):
            rest = value[i:]
            return "" if rest.strip().startswith("#") else rest
        i += 1
    return ""


def commands(text: str, marker: str, base_dir: str = ".") -> tuple[list[Expanded], list[str]]:
    """The words of every statement of `text` that runs `marker` once expanded, in order, and the sourced files not
    found; `ValueError` when such a statement cannot be split into words."""
    found: list[Expanded] = []
    scope = _Scope()
    _find(scope, text, marker, 0, found, base_dir)
    return found, scope.missing_sources


def _source(scope: _Scope, statement: str, base_dir: str, depth: int) -> bool:
    """Read the assignments of a `source FILE` statement's file into `scope`; False when `statement` is not one."""
    match = _SOURCE.match(statement)
    if match is None:
        return False
    words = scope.words(statement)
    name = words[1] if len(words) > 1 else ""
    if _PLACEHOLDER.search(name) or depth >= 3:
        scope.missing_sources.append(readable(name))
        return True
    file = find_beside(name, base_dir, beside_first=True)
    if file is not None:
        try:
            with open(file, encoding="utf-8") as fh:
                text = fh.read()
        except (OSError, UnicodeDecodeError):
            file = None
    if file is None:
        scope.missing_sources.append(name)
        return True
    _find(scope, text, "", depth + 1, [], os.path.dirname(file) or ".")
    return True


def _find(scope: _Scope, text: str, marker: str, depth: int, found: list[Expanded], base_dir: str) -> None:
    """Read `text`'s assignments into `scope`, and the statements that run `marker` into `found` (none for "")."""
    blocks = 0
    for statement in _statements(text):
        first = statement.split("\n", 1)[0]
        if not first or first.startswith("#"):
            continue
        if _BLOCK_CLOSE.match(first):
            blocks = max(0, blocks - 1)
            continue
        opens = bool(_BLOCK_OPEN.match(first)) and not _CLOSES_ITSELF.search(statement)
        if "\n" in statement and (heredoc := _HEREDOC.search(first)):
            head, body = statement.split("\n", 1)
            into = _READ_INTO.match(head)
            if into:  # `<<'EOF'` (quoted): the body is not expanded
                scope.scalars[into.group(1)] = body if heredoc.group(2) else scope.expand(body)
                continue
            statement = head + " " + body
        if _assign(scope, statement, in_block=blocks > 0) or _source(scope, statement, base_dir, depth):
            continue
        blocks += int(opens)
        if not marker:  # a sourced file: its assignments only
            continue
        expanded = scope.expand(statement)
        if marker not in expanded:
            continue
        try:
            words = shlex.split(expanded, comments=True)
        except ValueError as exc:
            raise ValueError(f"cannot split the command line ({exc})") from None
        if words and words[0] in _PRINTS:  # `echo $cmd` shows the command, it does not run it
            continue
        payload = _shell_payload(words)
        if payload is not None and marker in payload and depth < 3:
            _find(scope, payload, marker, depth + 1, found, base_dir)
        elif any(marker in w for w in words):
            alternatives = {i: [list(w) for w in a] for i, a in scope.alternatives.items()}
            found.append(Expanded(words, list(scope.unresolved), frozenset(scope.many), alternatives))


SCRIPT_ARGS = ('"$@"', "$@", '"$*"', "$*", '"${@}"', "${@}")


def script_args(what: str) -> bool:
    """`what` (an unread word's description) is the script's own arguments (`"$@"`)."""
    return what.split(":", 1)[0] in SCRIPT_ARGS


def unread_words(whats: list[str], none_given: bool) -> tuple[list[str], list[str]]:
    """(what stays unread, notes): the script's own arguments become a note when the check reads them as none."""
    if not none_given:
        return list(whats), []
    notes = [
        f"{readable(w.split(':', 1)[0])}: the script's arguments, read as none (--no-script-args): check the ones you "
        "pass, too"
        for w in whats
        if script_args(w)
    ]
    return [w for w in whats if not script_args(w)], notes


def readable(text: str) -> str:
    return _PLACEHOLDER.sub("<unread>", text)


def _shell_payload(words: list[str]) -> str | None:
    """The script a `bash -c "..."` / `sh -c '...'` in `words` runs, None without one."""
    for i, word in enumerate(words[:-2]):
        if word.rsplit("/", 1)[-1] in ("bash", "sh", "zsh", "dash") and words[i + 1] == "-c":
            return words[i + 2]
    return None
