"""The package's layout holds: folders say where code runs, and imports point one way.

Checked by walking every import statement of every module (also those inside functions), not by
hand. The sides:

- ``sparkhvd.common``: shared by all; imports nothing else of sparkhvd, and only the standard
  library at import time (third-party libraries inside functions);
- ``sparkhvd.storage``: shared I/O (fsspec/adlfs, Keras bytes); imports only ``common``;
- ``sparkhvd.rank``: the rank process; never imports the driver or the Spark task;
- ``sparkhvd.executor``: the Spark task; never imports the driver;
- ``sparkhvd.driver``: never imports the rank side (it reaches ranks only as a payload);
- the public modules on top (``sparkhvd``, ``sparkhvd.keras``, ``sparkhvd.data``, the CLI, ...)
  re-export the sides; no side imports them.
"""
from __future__ import annotations

import ast
import pathlib
import sys

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "sparkhvd"
SIDES = ("common", "storage", "rank", "executor", "driver")
#: side -> the sides it may import (besides itself).
ALLOWED = {
    "common": set(),
    "storage": {"common"},
    "rank": {"common", "storage"},
    "executor": {"common", "storage", "rank"},
    "driver": {"common", "storage", "executor"},
}


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        yield ".".join(parts), path


def _imports(path):
    """(module imported, line, at module level?) for every import in ``path``."""
    tree = ast.parse(path.read_text())
    top = {id(node) for node in tree.body}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno, id(node) in top, 0
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level == 0 and module == "sparkhvd":
                for alias in node.names:  # from sparkhvd import storage -> sparkhvd.storage
                    yield f"sparkhvd.{alias.name}", node.lineno, id(node) in top, 0
            else:
                yield module, node.lineno, id(node) in top, node.level


def _side(module):
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in SIDES else None


MODULES = dict(_modules())


def test_every_module_lives_in_a_side_or_is_public():
    public = {m for m in MODULES if _side(m) is None}
    assert public == {"sparkhvd", "sparkhvd.cli", "sparkhvd.keras", "sparkhvd.torch", "sparkhvd.data",
                      "sparkhvd.presets", "sparkhvd.notebook", "sparkhvd.kerasio",
                      "sparkhvd.runfiles", "sparkhvd.examples", "sparkhvd.examples.digits"}, \
        "a new top-level module: put it in the side where it runs"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_one_way(module):
    side = _side(module)
    wrong = []
    for name, line, at_top, level in _imports(MODULES[module]):
        if level:
            wrong.append(f"line {line}: relative import (write sparkhvd.<side>.<module>)")
            continue
        if not (name == "sparkhvd" or name.startswith("sparkhvd.")):
            if side == "common" and at_top and name.split(".")[0] not in sys.stdlib_module_names \
                    and name != "__future__":
                wrong.append(f"line {line}: common imports {name} at import time")
            continue
        target = _side(name)
        if side is None:
            continue  # public modules re-export any side
        if target is None and name != "sparkhvd":
            wrong.append(f"line {line}: imports public module {name}")
        elif target is not None and target != side and target not in ALLOWED[side]:
            wrong.append(f"line {line}: {side} imports {target} ({name})")
    assert not wrong, f"{module}:\n" + "\n".join(wrong)
