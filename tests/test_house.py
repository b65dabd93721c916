"""Every class in ``stalwart`` (every module under src/stalwart) owns the state it reads.

For each class, every ``self.X`` it reads (``self.X`` in a load context,
``self.X += ...`` or ``getattr(self, "X")``, in any method, nested functions included) must be
something the class or a class in its method resolution order defines:

- for a class of stalwart (any package), found by parsing its source: a method, a property
  or other class-level assignment, a field of a dataclass or ``NamedTuple`` (annotations
  without a value count only there: a bare annotation on a plain class declares state that
  someone else sets, which is what this test forbids), or an attribute some method assigns
  (``self.X = ...``, tuple targets, ``setattr(self, "X", ...)``; not ``self.X += ...``,
  which reads X first);
- for a class from outside stalwart (``object``, ``NamedTuple``'s tuple, an exception,
  ``Protocol``, ``torch.nn.Module``): whatever ``dir()`` of it lists, and, when its Python
  source is available, what that source defines by the rules above (``torch.optim.Optimizer``
  sets ``param_groups`` in its ``__init__``: a subclass reads state its base owns).

The method resolution order comes from importing the module (the bases as Python resolves
them); the definitions come from the source (the AST), so an attribute set from outside a
class (``obj.x = 1`` in another module) does not count as defined. Cost: parsing
every source file of src/stalwart (~200) and importing its module (torch included): several
seconds of CPU.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import sys
import textwrap
from functools import cache
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "stalwart"
ROOTS = {"stalwart"}  # top-level packages whose classes are read from their source


def _modules() -> list[str]:
    """Every module of src/stalwart, packages' ``__init__`` included."""
    out = []
    for p in sorted(SRC.rglob("*.py")):
        parts = list(p.relative_to(SRC.parent).with_suffix("").parts)
        out.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return out


def _is_dataclass_like(node: ast.ClassDef) -> bool:
    """A dataclass or a ``NamedTuple``: its annotated class-level names are fields."""
    for dec in node.decorator_list:
        target = dec.func if isinstance(dec, ast.Call) else dec
        name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
        if name == "dataclass":
            return True
    return any((isinstance(b, ast.Name) and b.id == "NamedTuple")
               or (isinstance(b, ast.Attribute) and b.attr == "NamedTuple")
               for b in node.bases)


def _self_name(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> str | None:
    """The name a method calls its instance (its first parameter), None for a static one."""
    if any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in fn.decorator_list):
        return None
    args = fn.args.posonlyargs + fn.args.args
    return args[0].arg if args else None


def _targets(t: ast.expr, me: str) -> list[str]:
    """The ``me.X`` names an assignment target binds."""
    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == me:
        return [t.attr]
    if isinstance(t, (ast.Tuple, ast.List)):
        return [n for e in t.elts for n in _targets(e, me)]
    if isinstance(t, ast.Starred):
        return _targets(t.value, me)
    return []


def _const_attr(call: ast.Call, me: str, fn: str) -> str | None:
    """``X`` of ``fn(me, "X", ...)`` (``getattr``/``setattr`` on the instance)."""
    if (isinstance(call.func, ast.Name) and call.func.id == fn and len(call.args) >= 2
            and isinstance(call.args[0], ast.Name) and call.args[0].id == me
            and isinstance(call.args[1], ast.Constant) and isinstance(call.args[1].value, str)):
        return call.args[1].value
    return None


def _methods(node: ast.ClassDef) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    return [n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def _defined(node: ast.ClassDef) -> set[str]:
    """What one class's own source defines (module docstring)."""
    return _class_level(node) | _assigned(node)


def _class_level(node: ast.ClassDef) -> set[str]:
    """The names a class body defines: methods, nested classes, assignments, fields."""
    names: set[str] = set()
    fields = _is_dataclass_like(node)
    for stmt in node.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(stmt.name)
        elif isinstance(stmt, ast.Assign):
            for t in stmt.targets:
                names.update(e.id for e in ast.walk(t) if isinstance(e, ast.Name))
        elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            if stmt.value is not None or fields:
                names.add(stmt.target.id)
    return names


def _assigned(node: ast.ClassDef) -> set[str]:
    """The ``self.X`` a class's methods assign (not ``+=``: that reads X first)."""
    names: set[str] = set()
    for fn in _methods(node):
        me = _self_name(fn)
        if me is None:
            continue
        for n in ast.walk(fn):
            if isinstance(n, ast.Assign):
                for t in n.targets:
                    names.update(_targets(t, me))
            elif isinstance(n, ast.AnnAssign):
                names.update(_targets(n.target, me))
            elif isinstance(n, ast.Call) and (x := _const_attr(n, me, "setattr")):
                names.add(x)
    return names


def _read(node: ast.ClassDef) -> dict[str, int]:
    """Every ``self.X`` one class's methods read, with the line of its first read."""
    reads: dict[str, int] = {}
    for fn in _methods(node):
        me = _self_name(fn)
        if me is None:
            continue
        for n in ast.walk(fn):
            name = None
            if (isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
                    and n.value.id == me and isinstance(n.ctx, ast.Load)):
                name = n.attr
            elif isinstance(n, ast.AugAssign) and (got := _targets(n.target, me)):
                name = got[0]  # (``self.X += 1`` reads X first)
            elif isinstance(n, ast.Call):
                name = _const_attr(n, me, "getattr")
            if name is not None:
                reads.setdefault(name, n.lineno)
    return reads


@cache
def _class_nodes(path: str) -> dict[str, ast.ClassDef]:
    """The classes of one source file by qualified name (nested classes included)."""
    out: dict[str, ast.ClassDef] = {}

    def visit(body: list[ast.stmt], prefix: str) -> None:
        for stmt in body:
            if isinstance(stmt, ast.ClassDef):
                out[prefix + stmt.name] = stmt
                visit(stmt.body, f"{prefix}{stmt.name}.")
    visit(ast.parse(Path(path).read_text()).body, "")
    return out


def _node_of(cls: type) -> ast.ClassDef | None:
    """A stalwart class's AST node, None for a class from elsewhere."""
    if cls.__module__.split(".")[0] not in ROOTS:
        return None
    path = inspect.getsourcefile(sys.modules[cls.__module__])
    assert path is not None
    return _class_nodes(path).get(cls.__qualname__)


@cache
def _external(cls: type) -> frozenset[str]:
    """What a class from outside stalwart defines: ``dir()``, and its source's definitions
    when Python can find its source (not for built-in or C classes)."""
    names = set(dir(cls))
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):
        return frozenset(names)
    node = tree.body[0]
    if isinstance(node, ast.ClassDef):
        names |= _defined(node)
    return frozenset(names)


def _available(cls: type) -> set[str]:
    """Everything ``cls`` or a class in its MRO defines (module docstring)."""
    names: set[str] = set()
    for base in cls.__mro__:
        node = _node_of(base)
        names |= _external(base) if node is None else _defined(node)
    return names


def _classes() -> list[tuple[str, type, ast.ClassDef]]:
    out = []
    for mod_name in _modules():
        mod = importlib.import_module(mod_name)
        path = inspect.getsourcefile(mod)
        assert path is not None
        for qual, node in _class_nodes(path).items():
            obj: object = mod
            for part in qual.split("."):
                obj = getattr(obj, part, None)
            if isinstance(obj, type) and obj.__module__ == mod_name:
                out.append((f"{mod_name}.{qual}", obj, node))
    return out


def unowned(cls: type, node: ast.ClassDef) -> dict[str, int]:
    """The attributes ``cls`` reads and nothing in its MRO defines, with a line of each."""
    have = _available(cls)
    return {k: line for k, line in _read(node).items() if k not in have}


def test_the_check_covers_the_packages() -> None:
    names = {n for n, _, _ in _classes()}
    assert {"stalwart.detect.decision.DecisionCore", "stalwart.detect.recovery.Following",
            "stalwart.detect.verdicts.VerdictLog", "stalwart.detect.exchange.ExchangeRow",
            "stalwart.mitigate.agreement.PlanMessage",
            "stalwart.mitigate.rebalance.WindowRow", "stalwart.comm.collective.LossyCollective",
            "stalwart.comm.receiving.Receiver", "stalwart.comm.sending.Sender",
            "stalwart.comm.phase.PhaseWait", "stalwart.comm.rounds.RoundRing",
            "stalwart.comm.optim.ShardedLossyOptimizer", "stalwart.train.model.Block"} <= names


def test_no_class_reads_state_it_does_not_own() -> None:
    bad = {name: unowned(cls, node) for name, cls, node in _classes()}
    bad = {k: v for k, v in bad.items() if v}
    assert not bad, "\n".join(f"{k}: {v}" for k, v in sorted(bad.items()))


_MIXIN = '''
class Counts:
    total: int
    def bump(self) -> None:
        self.total += 1
        print(getattr(self, "label"))

class Owner(Counts):
    def __init__(self) -> None:
        self.total = 0
'''


def test_the_check_finds_a_mixin_that_reads_what_it_never_sets(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch
                                                               ) -> None:
    """The check can fail: a mixin's bare annotation is not ownership, and a subclass's
    assignment does not count for its base."""
    pkg = tmp_path / "stalwart_fixture_house"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "m.py").write_text(_MIXIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys.modules[__name__], "ROOTS", {*ROOTS, "stalwart_fixture_house"})
    mod = importlib.import_module("stalwart_fixture_house.m")
    path = inspect.getsourcefile(mod)
    assert path is not None
    nodes = _class_nodes(path)
    assert unowned(mod.Counts, nodes["Counts"]) == {"total": 5, "label": 6}
    assert unowned(mod.Owner, nodes["Owner"]) == {}
