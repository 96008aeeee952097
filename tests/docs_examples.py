"""The documentation's code, as the tests see it: every example file, what it needs, the
placeholders a fixture fills in, and every fenced block of README.md and docs/ read back.

Code lives in ``docs/examples/*.py``; the docs include those files (``--8<--``, mkdocs'
snippets), README.md carries literal copies (checked to be identical), and
``tests/integration/test_docs_examples.py`` runs every file as written.
"""
from __future__ import annotations

import pathlib
import re
from dataclasses import dataclass, field

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES_DIR = ROOT / "docs" / "examples"


@dataclass(frozen=True)
class Example:
    #: what the example needs installed: "horovod", "tf" (run where TensorFlow has no horovod
    #: beside it: the modern profile), "torch", "connect"
    needs: tuple[str, ...]
    #: placeholder in the file -> the fixture attribute that replaces it
    placeholders: dict = field(default_factory=dict)
    #: what its output must say
    prints: str = ""
    #: files it must leave in its working folder (globs)
    leaves: tuple[str, ...] = ()


#: Every example file, and what it needs (which profile runs it).
EXAMPLES = {
    "quickstart_horovod.py": Example(("horovod",), prints="accuracy ",
                                     leaves=("runs/*/metrics.csv", "runs/*/curves.png")),
    "quickstart_tf.py": Example(("tf",), prints="accuracy "),
    "quickstart_torch.py": Example(("torch",), prints="accuracy "),
    "keras_resume.py": Example(("horovod",), prints="epoch,"),
    "dataframe_keras.py": Example(("horovod",), prints="accuracy on the executors "),
    "pytorch_helpers.py": Example(("torch",), prints="accuracy "),
    "dataframe_resume.py": Example(("torch",), prints="'step': 20"),
    "spot_elastic.py": Example(("torch",), prints="('restarting', 'epoch-0000-step-0000030.pt')"),
    "migrate_torchdistributor.py": Example(("torch",)),
    "migrate_horovod_spark.py": Example(("horovod",)),
    "migrate_mirrored_strategy_runner.py": Example(("tf",), prints="accuracy "),
    "connect_tf.py": Example(("connect",), prints="'epochs': 5"),
    "storage_abfss.py": Example((), placeholders={
        "abfss://models@myaccount.dfs.core.windows.net/runs": "runs_url",
        "DefaultEndpointsProtocol=https;AccountName=myaccount;AccountKey=...;": "connection"},
        prints="rank 0's bytes after 3 epochs"),
    "settings_groups.py": Example(()),
}

#: The CLI commands the docs show in bash blocks (`sparkhvd` from the venv), and the test that
#: runs each as written ("docs": tests/integration/test_docs_examples.py).
DOCTOR = "sparkhvd doctor --np 2"
CLI_COMMANDS = {
    "sparkhvd presets": "docs",
    "sparkhvd presets show gpu-large --as configure": "docs",
    DOCTOR: "tests/integration/test_cli.py::test_doctor_passes_on_this_machine",
}

FENCE = re.compile(r"(?ms)^```(\w*)[^\n]*\n(.*?)^```")
SNIPPET = re.compile(r'^--8<-- "(docs/examples/[\w.]+\.py)(:[\w-]+)?"$')


def markdown_files() -> list[pathlib.Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def blocks(path: pathlib.Path) -> list[tuple[str, str]]:
    """``(language, text)`` of every fenced block of a Markdown file."""
    return [(m.group(1), m.group(2)) for m in FENCE.finditer(path.read_text())]


def example_text(name: str) -> str:
    return (EXAMPLES_DIR / name).read_text()
