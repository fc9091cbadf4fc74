"""The package's size in code lines: what the interpreter runs, not the prose that explains it.

`code` (the figure issue 45 sets a target for, at most 11,400): the source lines a token of code stands on (a
multi-line literal counts every line it spans); comments, blank lines and docstrings do not count. A docstring is any
statement that is only a string literal (module, class and function docstrings, attribute docstrings), found through
the AST. Wrapping counts: a message split over three lines to stay within 120 columns is three lines.
`unparsed`, for comparison: the non-blank lines of `ast.unparse` of each module without its docstrings, which no
wrapping changes (but which puts a whole expression, such as the rule table, on one line).
Per package of `trl_gc_plugin` (`(top)`: the modules directly in it) and in total.

    python benchmarks/code_lines.py [--root trl_gc_plugin] [--json]
"""

from __future__ import annotations

import argparse
import ast
import io
import json
import tokenize
from pathlib import Path

TARGET = 11_400
NOT_CODE = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}


def docstring_lines(tree: ast.AST) -> set[int]:
    """The lines of every statement that is only a string literal."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            lines.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    return lines


def _is_docstring(statement: ast.stmt) -> bool:
    return (
        isinstance(statement, ast.Expr)
        and isinstance(statement.value, ast.Constant)
        and isinstance(statement.value.value, str)
    )


def unparsed_lines(source: str) -> int:
    """The non-blank lines of `source` unparsed from its AST without docstrings."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        for name in ("body", "orelse", "finalbody"):
            body = getattr(node, name, None)
            if isinstance(body, list) and any(isinstance(s, ast.stmt) and _is_docstring(s) for s in body):
                setattr(node, name, [s for s in body if not _is_docstring(s)] or [ast.Pass()])
    return sum(1 for line in ast.unparse(tree).splitlines() if line.strip())


def code_lines(source: str) -> int:
    """The lines of `source` a token of code stands on (a multi-line literal counts every line), docstrings excluded."""
    lines: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in NOT_CODE:
            lines.update(range(token.start[0], token.end[0] + 1))
    return len(lines - docstring_lines(ast.parse(source)))


def count(root: Path) -> dict[str, tuple[int, int]]:
    """(code lines, unparsed lines) per package of `root` (`(top)` for its own modules), sorted by name."""
    sizes: dict[str, tuple[int, int]] = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        package = parts[0] if len(parts) > 1 else "(top)"
        source = path.read_text(encoding="utf-8")
        code, unparsed = sizes.get(package, (0, 0))
        sizes[package] = (code + code_lines(source), unparsed + unparsed_lines(source))
    return dict(sorted(sizes.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=str(Path(__file__).resolve().parent.parent / "trl_gc_plugin"))
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()
    sizes = count(Path(args.root))
    total = sum(code for code, _ in sizes.values())
    unparsed = sum(lines for _, lines in sizes.values())
    if args.json:
        packages = {name: {"code": code, "unparsed": lines} for name, (code, lines) in sizes.items()}
        print(json.dumps({"packages": packages, "total": total, "unparsed": unparsed, "target": TARGET}, indent=2))
        return
    width = max(len(name) for name in [*sizes, "package"])
    print(f"{'package':<{width}}  {'code':>6}  {'unparsed':>8}")
    for name, (code, lines) in sizes.items():
        print(f"{name:<{width}}  {code:>6,}  {lines:>8,}")
    verdict = "met" if total <= TARGET else "not met"
    print(f"{'total':<{width}}  {total:>6,}  {unparsed:>8,}  (target: code <= {TARGET:,}, {verdict})")


if __name__ == "__main__":
    main()
