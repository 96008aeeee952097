"""The package's layout holds: every module says where it runs, and imports point one way.

Every module carries a side tag (``__side__ = "driver"``), read here from its source -- not
guessed from its folder, because a feature folder (``data/``, ``keras/``, ``torch/``,
``runfolder/``, ``scoring/``, ``ops/``) holds both halves of its feature. Checked by walking
every import statement of every module (also those inside functions). The sides:

- ``common``: shared by all; imports nothing else of sparkhvd but ``common``, and only the
  standard library at import time (third-party libraries inside functions);
- ``shared``: shared I/O with third-party imports (fsspec/adlfs, Keras bytes); imports
  ``common``;
- ``rank``: the rank process; never imports the driver or the Spark task;
- ``executor``: the Spark task; never imports the driver;
- ``driver``: never imports the rank side (it reaches ranks only as a payload);
- ``public``: the package faces (``sparkhvd``, ``sparkhvd.keras``, ``sparkhvd.data``, ...)
  re-export any side; no side imports them, except ``common.faces`` which they call.

And the folders stand in one order (:data:`FLOORS`, the ground first): a module imports only
its own folder and the folders on floors below it -- no import runs back up, so no two folders
lean on each other and a folder can be read knowing only what stands below it.
"""
from __future__ import annotations

import ast
import pathlib
import sys

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "sparkhvd"
#: side -> the sides it may import (besides itself).
ALLOWED = {
    "common": set(),
    "shared": {"common"},
    "rank": {"common", "shared"},
    "executor": {"common", "shared", "rank"},
    "driver": {"common", "shared", "executor"},
    "public": {"common", "shared", "rank", "executor", "driver", "public"},
}
#: Package faces: the public modules (each a package's ``__init__`` or ``__main__``).
FACES = {"sparkhvd", "sparkhvd.__main__", "sparkhvd.keras", "sparkhvd.torch", "sparkhvd.data",
         "sparkhvd.runfolder", "sparkhvd.scoring", "sparkhvd.ops", "sparkhvd.examples",
         "sparkhvd.examples.digits"}
#: The package's folders from the ground up. A module may import its own folder and any folder
#: on a lower floor; folders on one floor never import each other.
FLOORS = [
    {"common"},  # the message protocol, a rank's identity and events, shared by every side
    {"storage", "elastic", "timing"},  # I/O; notices and resizing; where the time goes
    {"spark"},  # the driver's view of Spark: session, slots, what is installed, presets
    {"runfolder", "data"},  # what a run leaves behind; DataFrames to every rank's batches
    {"checkpoint"},  # the checkpoint lineage, its stores, host copies, the nearest copy
    {"keras"},  # Keras/TF integration (checkpoints into the run folder, notices)
    {"rank", "scoring"},  # the rank process, wiring the rank halves below; scoring a DataFrame
    {"executor"},  # the Spark task that starts ranks
    {"driver"},  # the run: settings, placing, launchers, attempts, recording
    {"torch", "ops"},  # TorchDistributor on the runner; the CLI and doctor
    {"examples"},
]
#: An import that runs back up, declared with why it must (at most 4; none today).
BACK_UP: dict[tuple[str, str], str] = {}
#: Old public module names -> the modules that moved, each old name a shim module beside the
#: package's face (``sparkhvd/presets.py``) that hands its moved module on
#: (tests/integration/test_cli.py runs each with ``python -m`` too).
OLD_NAMES = {
    "sparkhvd.presets": "sparkhvd.spark.presets",
    "sparkhvd.notebook": "sparkhvd.ops.notebook",
    "sparkhvd.cli": "sparkhvd.ops.cli",
    "sparkhvd.runfiles": "sparkhvd.runfolder.rank_files",
    "sparkhvd.kerasio": "sparkhvd.keras.modelio",
}


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        yield ".".join(parts), path


def _side_tag(path):
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__side__"
                                                for t in node.targets):
            return node.value.value
    return None


def _imports(path):
    """(module imported, line, at module level?, level) for every import in ``path``."""
    tree = ast.parse(path.read_text())
    top = {id(node) for node in tree.body}
    typing_only = {id(inner) for node in ast.walk(tree)  # `if TYPE_CHECKING:` never runs
                   if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING"
                   for inner in ast.walk(node)}
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno, id(node) in top, 0
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level == 0 and module.startswith("sparkhvd"):
                for alias in node.names:  # from sparkhvd.x import y -> sparkhvd.x.y if a module
                    sub = f"{module}.{alias.name}"
                    yield (sub if sub in MODULES else module), node.lineno, id(node) in top, 0
            else:
                yield module, node.lineno, id(node) in top, node.level


MODULES = dict(_modules())
SIDES = {module: _side_tag(path) for module, path in MODULES.items()}


def test_every_module_says_where_it_runs():
    untagged = sorted(m for m, side in SIDES.items() if side not in ALLOWED)
    assert not untagged, f"add __side__ = 'driver'|'executor'|'rank'|'common'|'shared': {untagged}"
    public = {m for m, side in SIDES.items() if side == "public"}
    assert public == FACES | set(OLD_NAMES), "only package faces (and the old names of moved " \
        "modules) are public; put a new module in its feature folder with the side it runs on"


def test_an_old_module_name_is_its_module_itself():
    """``sparkhvd.presets`` and the other old names (:data:`OLD_NAMES`): plain shim modules
    that hand the moved module itself on (the same object, its state shared)."""
    import importlib

    for old, new in OLD_NAMES.items():
        assert importlib.import_module(old) is importlib.import_module(new), old


def test_no_shim_modules():
    """A module that only re-exports is a package face, never a file beside the code."""
    for module, path in MODULES.items():
        body = [n for n in ast.parse(path.read_text()).body
                if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
        only_imports = body and all(isinstance(n, (ast.Import, ast.ImportFrom, ast.Assign))
                                    for n in body)
        if only_imports and module not in FACES and not path.name == "__init__.py":
            pytest.fail(f"{module} only re-exports: fold it into its package face")


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_one_way(module):
    side = SIDES[module]
    wrong = []
    for name, line, at_top, level in _imports(MODULES[module]):
        if level:
            wrong.append(f"line {line}: relative import (write sparkhvd.<folder>.<module>)")
            continue
        if not (name == "sparkhvd" or name.startswith("sparkhvd.")):
            if side == "common" and at_top and name.split(".")[0] not in sys.stdlib_module_names \
                    and name != "__future__":
                wrong.append(f"line {line}: common imports {name} at import time")
            continue
        target = SIDES.get(name)
        if target is None:
            continue  # an alias (sparkhvd.presets) or a name, not a module
        if module == name.rsplit(".", 1)[0] or name == "sparkhvd.common.faces":
            continue
        if target == "public" and side != "public":
            wrong.append(f"line {line}: {side} module imports the package face {name}")
        elif target != side and target != "public" and target not in ALLOWED[side]:
            wrong.append(f"line {line}: {side} imports {target} ({name})")
    assert not wrong, f"{module} ({side}):\n" + "\n".join(wrong)


def test_no_import_circle():
    """Imports between sparkhvd's modules (also those inside functions) form no cycle."""
    graph = {m: {n for n, _, _top, lvl in _imports(p) if not lvl and n in MODULES
                 and n != m and SIDES.get(n) != "public"}
             for m, p in MODULES.items() if SIDES[m] != "public"}
    seen: dict[str, int] = {}

    def visit(node, stack):
        seen[node] = 1
        for nxt in graph.get(node, ()):
            if seen.get(nxt) == 1:
                pytest.fail("import circle: " + " -> ".join([*stack[stack.index(nxt):], nxt]))
            if nxt not in seen:
                visit(nxt, [*stack, nxt])
        seen[node] = 2

    for module in sorted(graph):
        if module not in seen:
            visit(module, [module])


@pytest.mark.parametrize("face", ["sparkhvd.data", "sparkhvd.keras", "sparkhvd.torch",
                                  "sparkhvd.runfolder", "sparkhvd.scoring"])
def test_no_public_name_is_also_a_submodule(face):
    """`from sparkhvd.scoring import predict` must be the function: a submodule of the same
    name would replace it as the package's attribute once imported."""
    import importlib

    package = importlib.import_module(face)
    folder = PACKAGE.parent.joinpath(*face.split("."))
    clashes = [name for name in package.__all__ if (folder / f"{name}.py").exists()]
    assert not clashes, f"{face} exports {clashes}, which are also its submodules"


def _folder(module):
    """The top folder of a module of the package (None for a top-level file: a face or an old
    name)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and (PACKAGE / parts[1]).is_dir()) \
        else None


def test_every_folder_stands_on_a_floor():
    folders = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    placed = set().union(*FLOORS)
    assert folders == placed, f"put each folder on one floor of FLOORS: " \
        f"missing {sorted(folders - placed)}, gone {sorted(placed - folders)}"
    assert len(BACK_UP) <= 4


@pytest.mark.parametrize("module", sorted(m for m in MODULES if SIDES[m] != "public"))
def test_no_import_runs_back_up(module):
    """Also imports inside functions: a lazy import is still a dependency of the folder."""
    floor = {folder: n for n, floor in enumerate(FLOORS) for folder in floor}
    here = _folder(module)
    wrong = []
    for name, line, _top, level in _imports(MODULES[module]):
        if level or name not in MODULES or SIDES.get(name) == "public":
            continue
        there = _folder(name)
        if there is None or there == here or (here, there) in BACK_UP:
            continue
        if floor[there] >= floor[here]:
            wrong.append(f"line {line}: {name} ({there}/, floor {floor[there]}) from "
                         f"{here}/ (floor {floor[here]})")
    assert not wrong, f"{module} imports upward or sideways -- move the code to the floor " \
        f"that owns it, or pass it in from above:\n" + "\n".join(wrong)
