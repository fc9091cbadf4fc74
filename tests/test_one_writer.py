"""`use_reentrant` has one writer and one holder (issue 45): every write of the value into the arguments or the live
model goes through `model/write.py`'s `write_use_reentrant`, and the value in force with who chose it is set only
by `UseReentrant.hold` beside it (which keeps the arguments' post-init record in step). A scan of the package's source,
so that a new path that writes it on its own fails here rather than drifting from the run's record."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import trl_gc_plugin

pytestmark = pytest.mark.line_independent

PACKAGE = Path(trl_gc_plugin.__file__).parent


class _Calls(ast.NodeVisitor):
    """The calls of one module for which `predicate(call)` holds, with their enclosing function's dotted name."""

    def __init__(self, module: str, predicate) -> None:
        self.module, self.predicate = module, predicate
        self.stack: list[str] = []
        self.found: list[tuple[str, str]] = []

    def generic_visit(self, node: ast.AST) -> None:
        named = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        if named:
            self.stack.append(node.name)
        if isinstance(node, ast.Call) and self.predicate(node):
            self.found.append((self.module, ".".join(self.stack)))
        super().generic_visit(node)
        if named:
            self.stack.pop()


def _functions_with(predicate) -> list[tuple[str, str]]:
    """(module path, enclosing function) of every call in the package for which `predicate(call)` holds."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        calls = _Calls(str(path.relative_to(PACKAGE)), predicate)
        calls.visit(ast.parse(path.read_text(encoding="utf-8")))
        found += calls.found
    return found


def _name(call: ast.Call) -> str:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""


def _writes_use_reentrant(call: ast.Call) -> bool:
    """`set_args_kwarg(args, "use_reentrant", ...)` / `set_keyword(model, "use_reentrant", ...)`."""
    if _name(call) not in ("set_args_kwarg", "set_keyword"):
        return False
    return any(isinstance(a, ast.Constant) and a.value == "use_reentrant" for a in call.args)


def test_the_value_is_written_in_one_function():
    assert _functions_with(_writes_use_reentrant) == [
        ("model/write.py", "write_use_reentrant"),
        ("model/write.py", "write_use_reentrant"),
    ]


def test_the_value_in_force_is_held_in_one_place():
    remembered = _functions_with(lambda call: _name(call) == "remember")
    # the run's holder; and the label of a value Axolotl wrote before the plugin ran (who set it, no value written)
    assert sorted(set(remembered)) == [
        ("model/write.py", "UseReentrant.hold"),
        ("runtime/hosts.py", "label_axolotl_value"),
    ]


def test_only_the_holder_sets_what_it_holds():
    """`UseReentrant.hold` is the one setter: no module assigns the held value or its source around it."""
    around = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            else:
                continue
            for target in targets:
                for one in target.elts if isinstance(target, ast.Tuple) else [target]:
                    # `<anything>.reentrant.value = ...` / `.source = ...`
                    holder = one.value if isinstance(one, ast.Attribute) else None
                    if isinstance(holder, ast.Attribute) and holder.attr == "reentrant":
                        around.append((str(path.relative_to(PACKAGE)), node.lineno))
    assert around == []


def test_every_write_goes_through_the_writer():
    callers = {where for where in _functions_with(lambda call: _name(call) == "write_use_reentrant")}
    assert callers == {
        ("model/write.py", "_use_reentrant"),  # the decision on the arguments
        ("model/write.py", "_model_use_reentrant"),  # the decision on the live model
        ("model/write.py", "_fsdp_checkpointing_off"),  # FSDP's own checkpointing replaced by the Trainer's
        ("model/write.py", "UseReentrant.switch"),  # a runtime check's switch (first forward, first step, drift)
        ("runtime/run.py", "Run.decide"),  # the post-init default withdrawn under a launcher's own function
    }
