"""The package's shape (issue 37): packages by concern whose imports run one way, no import cycle, small units.

Every import of every module is read from its source (those inside functions and under `TYPE_CHECKING` too), so a
cycle cannot hide behind an import made late.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.line_independent

PACKAGE = Path(__file__).resolve().parents[1] / "trl_gc_plugin"
ORDER = ("routes", "runtime", "planning", "model", "core", "_base")
"""The layers, each importing only those after it."""
ENTRY = frozenset(
    {"__init__", "__main__", "cli", "plan_cli", "testing", "_startup", "integrations", "configcheck.read._worker"}
)
"""Entry points (the public names, the CLIs, the start-up hook, the Axolotl plugin, the check's worker process): they
may import any layer."""
CONFIGCHECK_MAY_IMPORT = frozenset({"configcheck", "core", "_base"})
CONFIGCHECK_ORDER = ("configcheck", "configcheck.launchers", "configcheck.read")
"""`configcheck`'s own packages, each importing only those after it: the check (`check`, `detect`), the launcher
readers, what they share (loading, the shell, side files, the launchers' own parsers)."""
HEAVY = ("torch", "transformers", "trl", "peft", "accelerate", "deepspeed")


def modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts) or "__init__"
        out[name] = path
    return out


MODULES = modules()


def imports(name: str) -> list[tuple[str, int]]:
    """(module of this package, line) for every import `name` makes; `__init__` for the package itself."""
    path = MODULES[name]
    package = name.split(".") if path.name == "__init__.py" and name != "__init__" else name.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            elif (node.module or "").startswith("trl_gc_plugin"):
                target = node.module.removeprefix("trl_gc_plugin").lstrip(".")
            else:
                continue
            subs = [f"{target}.{a.name}".lstrip(".") for a in node.names]
            hits = [s for s in subs if s in MODULES]
            found += [(s, node.lineno) for s in hits] or [(target or "__init__", node.lineno)]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("trl_gc_plugin."):
                    found.append((alias.name.removeprefix("trl_gc_plugin."), node.lineno))
    return found


def layer(name: str) -> str:
    if name in ENTRY or name.split(".")[0] in ENTRY:
        return "entry"
    return name.split(".")[0] if "." in name else "entry"


def test_every_module_is_in_a_layer():
    assert {layer(m) for m in MODULES} <= {"entry", "configcheck", *ORDER}, sorted(MODULES)


def test_imports_run_one_way():
    against = []
    for name in MODULES:
        mine = layer(name)
        if mine == "entry":
            continue
        for target, line in imports(name):
            theirs = layer(target)
            if target in ("__init__", name) or theirs == mine:
                continue
            if mine == "configcheck":
                ok = theirs in CONFIGCHECK_MAY_IMPORT
            else:
                ok = theirs in ORDER and ORDER.index(theirs) > ORDER.index(mine)
            if not ok:
                against.append(f"{name}:{line} imports {target} ({mine} -> {theirs})")
    assert not against, "\n".join(against)


def test_no_import_cycle():
    graph = {name: {t for t, _ in imports(name) if t in MODULES and t != name} for name in MODULES}
    cycles, index, low, stack, on, counter = [], {}, {}, [], set(), [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    assert not cycles, cycles


def configcheck_part(name: str) -> str:
    return next(part for part in reversed(CONFIGCHECK_ORDER) if name == part or name.startswith(part + "."))


def test_configcheck_imports_run_one_way():
    """The launcher readers import `read`, never the check; `read` imports no launcher reader (issue 45)."""
    against = []
    for name in MODULES:
        if layer(name) != "configcheck":
            continue
        mine = configcheck_part(name)
        for target, line in imports(name):
            if layer(target) != "configcheck" or target == name:
                continue
            theirs = configcheck_part(target)
            if CONFIGCHECK_ORDER.index(theirs) < CONFIGCHECK_ORDER.index(mine):
                against.append(f"{name}:{line} imports {target} ({mine} -> {theirs})")
    assert not against, "\n".join(against)


@pytest.mark.parametrize("name", sorted(n for n in MODULES if layer(n) in ("core", "_base")))
def test_the_core_imports_no_heavy_package(name):
    """`core` and `_base` run without torch or transformers (the check and the start-up route)."""
    heavy = []
    for node in ast.walk(ast.parse(MODULES[name].read_text())):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        heavy += [n for n in names if n.split(".")[0] in HEAVY]
    assert not heavy, heavy


def test_no_class_over_300_lines_nor_function_over_80():
    big = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            size = (node.end_lineno or node.lineno) - node.lineno + 1 if hasattr(node, "end_lineno") else 0
            if isinstance(node, ast.ClassDef) and size > 300:
                big.append(f"class {name}.{node.name}: {size}")
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and size > 80:
                big.append(f"def {name}.{node.name}: {size}")
    assert not big, big
