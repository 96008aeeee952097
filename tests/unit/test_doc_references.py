"""Every name of ours that a docstring or a docs page points at exists, so a stale one fails CI.

Checked: Sphinx roles in docstrings and pages (``:mod:``, ``:class:``, ``:func:``, ``:meth:``,
``:data:``, ``:attr:``, ``:exc:``) whose target is a ``sparkhvd.`` path, and code spans that
are a dotted ``sparkhvd.`` path (````sparkhvd.x.y```` in docstrings, ```sparkhvd.x.y``` on
pages). Resolved from the source, without importing it, so the torch and TensorFlow halves are
checked in every profile: a module is a file (or a package's ``__init__.py``); a name in it is
a top-level definition, assignment or import, a name its lazy face hands on
(:func:`sparkhvd.common.faces.lazy_face`, ``sparkhvd._LAZY``) or one its ``__all__`` promises;
a member of a class is a method, a nested class or an attribute it assigns. What an import
re-exports is not followed. The MLflow tags and params :mod:`sparkhvd.driver.tracking` writes
(``sparkhvd.run_id``, ``sparkhvd.resizeN``, ...) are names, not paths, and are left alone.
"""
from __future__ import annotations

import ast
import functools
import re
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[2]
ROLE = re.compile(r":(?:mod|class|func|meth|data|attr|exc):`~?\s*([^`]+?)`", re.S)
DOCSTRING_SPAN = re.compile(r"``(sparkhvd(?:\.\w+)+)(?:\(\))?``")
PAGE_SPAN = re.compile(r"(?<!`)`(sparkhvd(?:\.\w+)+)(?:\(\))?`(?!`)")


def _module_file(dotted: str) -> Optional[Path]:
    path = ROOT.joinpath(*dotted.split("."))
    if path.with_suffix(".py").is_file():
        return path.with_suffix(".py")
    if (path / "__init__.py").is_file():
        return path / "__init__.py"
    return None


@functools.lru_cache(maxsize=None)
def _top_names(path: Path) -> dict[str, ast.AST]:
    """A module's names: definitions, assignments and imports at any depth outside functions
    and classes (``if``/``try`` blocks count), and what its lazy face hands on."""
    tree = ast.parse(path.read_text())
    names: dict[str, ast.AST] = {}

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names[node.name] = node
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                for alias in node.names:
                    names[(alias.asname or alias.name).split(".")[0]] = node
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    for sub in ast.walk(target):
                        if isinstance(sub, ast.Name):
                            names[sub.id] = node
            for field in ("body", "orelse", "finalbody", "handlers"):
                inner = getattr(node, field, None)
                if isinstance(inner, list) and not isinstance(
                        node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    visit([n for n in inner if isinstance(n, ast.stmt)] +
                          [s for h in inner if isinstance(h, ast.ExceptHandler) for s in h.body])

    visit(tree.body)
    sequences = {target.id: node.value for node in tree.body if isinstance(node, ast.Assign)
                 for target in node.targets if isinstance(target, ast.Name)}

    def strings(node: ast.AST) -> list[str]:
        found = []
        for sub in ast.walk(node):
            if isinstance(sub, ast.Constant) and isinstance(sub.value, str):
                found.append(sub.value)
            elif isinstance(sub, ast.Name) and sub.id in sequences and sub.id != "__all__" and \
                    isinstance(sequences[sub.id], (ast.Tuple, ast.List)):
                found += strings(sequences[sub.id])
        return found

    if "__all__" in sequences:
        for name in strings(sequences["__all__"]):
            names.setdefault(name, sequences["__all__"])
    for node in ast.walk(tree):  # lazy_face(__name__, {...}) and sparkhvd's own _LAZY = {...}
        lazy = (isinstance(node, ast.Call) and getattr(node.func, "id", "") == "lazy_face") or \
            (isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "_LAZY"
                                                  for t in node.targets))
        if lazy:
            for sub in ast.walk(node):
                if isinstance(sub, ast.Dict):
                    for key in sub.keys:
                        if isinstance(key, ast.Constant) and isinstance(key.value, str):
                            names.setdefault(key.value, sub)
                        elif key is None or isinstance(key, ast.Name):
                            for name in strings(key) if key is not None else []:
                                names.setdefault(name, sub)
                if isinstance(sub, ast.DictComp):
                    for name in strings(sub.generators[0].iter):
                        names.setdefault(name, sub)
    return names


@functools.lru_cache(maxsize=None)
def _mlflow_names() -> tuple[set[str], tuple[str, ...]]:
    """What :mod:`sparkhvd.driver.tracking` writes: whole names, and the prefixes of numbered
    ones (``f"sparkhvd.resize{n}"``)."""
    tree = ast.parse((ROOT / "sparkhvd" / "driver" / "tracking.py").read_text())
    whole = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)
             and isinstance(n.value, str) and n.value.startswith("sparkhvd.")}
    prefixes = tuple(n.values[0].value for n in ast.walk(tree) if isinstance(n, ast.JoinedStr)
                     and n.values and isinstance(n.values[0], ast.Constant)
                     and str(n.values[0].value).startswith("sparkhvd."))
    return whole, prefixes


def _an_mlflow_name(target: str) -> bool:
    whole, prefixes = _mlflow_names()
    return target in whole or any(re.fullmatch(re.escape(p) + r"([A-Z]|\d+)", target)
                                  for p in prefixes)


def _members(cls: ast.ClassDef) -> set[str]:
    found = set()
    for node in ast.walk(cls):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found.add(node.name)
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, ast.AnnAssign) else []
        for target in targets:
            if isinstance(target, ast.Name):
                found.add(target.id)
            elif isinstance(target, ast.Attribute):
                found.add(target.attr)
    return found


def resolves(target: str) -> bool:
    """Whether the dotted ``sparkhvd.`` path names a module, a name in one, or a class member."""
    parts = target.split(".")
    for cut in range(len(parts), 0, -1):
        path = _module_file(".".join(parts[:cut]))
        if path is None:
            continue
        rest = parts[cut:]
        if not rest:
            return True
        node = _top_names(path).get(rest[0])
        if node is None:
            return False
        if len(rest) == 1 or not isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.Assign,
                                                   ast.AnnAssign)):
            return True  # a re-export is not followed
        return isinstance(node, ast.ClassDef) and len(rest) == 2 and rest[1] in _members(node)
    return False


def _docstrings(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                found.append(doc)
    # attribute docstrings ("#: ..." are comments; a string after an assignment is one)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list):
            for before, after in zip(body, body[1:]):
                if isinstance(before, (ast.Assign, ast.AnnAssign)) and \
                        isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) \
                        and isinstance(after.value.value, str):
                    found.append(after.value.value)
    return found


def _targets(text: str, span: re.Pattern) -> list[str]:
    found = []
    for match in ROLE.finditer(text):
        target = re.sub(r"\s+", "", match.group(1))
        target = re.sub(r"^.*<(.+)>$", r"\1", target).lstrip("~.").removesuffix("()")
        if target.startswith("sparkhvd.") or target == "sparkhvd":
            found.append(target)
    found += [m.group(1) for m in span.finditer(text)]
    return [target for target in found if not _an_mlflow_name(target)]


def test_the_resolver_finds_what_exists_and_only_that():
    assert resolves("sparkhvd.common.protocol.Hello")
    assert resolves("sparkhvd.driver.run.Run._step")
    assert resolves("sparkhvd.keras.KerasDistributed")  # through the lazy face
    assert resolves("sparkhvd.torch")
    assert not resolves("sparkhvd.executor.process.RankProcess")  # moved long ago
    assert not resolves("sparkhvd.driver.run.Run.no_such_method")
    assert not resolves("sparkhvd.no_such_module")
    assert _an_mlflow_name("sparkhvd.resizeN") and _an_mlflow_name("sparkhvd.run_id")
    assert not _an_mlflow_name("sparkhvd.environment")


def test_every_sparkhvd_name_in_a_docstring_exists():
    stale = [f"{path.relative_to(ROOT)}: {target}"
             for path in sorted((ROOT / "sparkhvd").rglob("*.py"))
             for doc in _docstrings(path)
             for target in _targets(doc, DOCSTRING_SPAN) if not resolves(target)]
    assert not stale, "docstrings name what does not exist:\n" + "\n".join(stale)


def test_every_sparkhvd_name_on_a_docs_page_exists():
    pages = sorted((ROOT / "docs").rglob("*.md")) + [ROOT / "README.md"]
    stale = [f"{page.relative_to(ROOT)}: {target}" for page in pages
             for target in _targets(page.read_text(), PAGE_SPAN) if not resolves(target)]
    assert not stale, "the docs name what does not exist:\n" + "\n".join(stale)
