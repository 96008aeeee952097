"""Every code block of README.md and docs/ is one the tests run, as written.

- a Python block in docs/ includes an example file (``--8<-- "docs/examples/x.py"``) that
  tests/integration/test_docs_examples.py runs;
- a Python block in README.md is, character for character, one of those files (no drift);
- a bash block holds only `make <target>` (a real target), `pip install` of real extras, and
  `sparkhvd ...` commands the tests run;
- a ``text`` block is output or a file tree, never code.
"""
from __future__ import annotations

import re
import shlex
from importlib.metadata import metadata

import pytest

from docs_examples import (
    CLI_COMMANDS,
    EXAMPLES,
    EXAMPLES_DIR,
    ROOT,
    SNIPPET,
    blocks,
    example_text,
    markdown_files,
)

PAGES = markdown_files()


def test_every_example_file_is_registered_and_every_registered_file_exists():
    files = {p.name for p in EXAMPLES_DIR.glob("*.py")}
    assert files == set(EXAMPLES), "register each docs/examples file in tests/docs_examples.py"


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_code_block_is_tested(page):
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"(?m)^([\w-]+):", makefile))
    extras = set(metadata("sparkhvd").get_all("Provides-Extra") or [])
    readme = page.name == "README.md"
    for language, text in blocks(page):
        body = text.strip("\n")
        if language == "python":
            if readme:
                assert any(body == example_text(n).strip("\n") for n in EXAMPLES), \
                    f"README block differs from every docs/examples file:\n{body[:300]}"
            else:
                match = SNIPPET.match(body)
                assert match, f"{page.name}: a Python block must include a docs/examples " \
                              f"file (--8<-- \"docs/examples/x.py\"):\n{body[:300]}"
                assert match.group(1).split("/")[-1] in EXAMPLES
        elif language == "bash":
            for line in body.splitlines():
                command = line.split("  #")[0].strip()
                if not command or command.startswith("#"):
                    continue
                words = shlex.split(command)
                if words[0] == "make":
                    assert words[1] in targets, f"make {words[1]}: no such target"
                elif words[:2] == ["pip", "install"]:
                    for spec in words[2:]:
                        found = re.fullmatch(r"sparkhvd(\[([\w,-]+)\])?", spec)
                        assert found, f"{page.name}: pip install {spec}: only sparkhvd"
                        assert set((found.group(2) or "").split(",")) - {""} <= extras, spec
                else:
                    assert command in CLI_COMMANDS, \
                        f"{page.name}: `{command}` is not a command the tests run " \
                        "(tests/docs_examples.py CLI_COMMANDS)"
        else:
            assert language == "text", \
                f"{page.name}: a ```{language or '(no language)'} block: use python (an " \
                "example file), bash (tested commands) or text (output, not code)"


def test_the_readme_is_a_front_door():
    """The two commands a newcomer types come first, and the rest fits on a page or two: what is
    longer belongs on the docs site."""
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines: move detail into docs/"
    assert lines[2] == "```bash" and lines[3].startswith("make demo") and \
        lines[4].startswith("make test"), lines[:6]


_REFERENCE = re.compile(r":(?:mod|class|func|meth|data|attr|exc):`([^`]+)`")


def _resolves(ref: str) -> bool:
    """Whether ``sparkhvd.a.b.Name.attr`` names something that exists (True when a module on the
    way needs a library this profile lacks: another profile checks it)."""
    import importlib

    parts = ref.split(".")
    try:
        for cut in range(len(parts), 0, -1):
            try:
                found: object = importlib.import_module(".".join(parts[:cut]))
            except ModuleNotFoundError as exc:
                if exc.name and exc.name.startswith("sparkhvd"):
                    continue
                raise
            for name in parts[cut:]:
                if hasattr(found, name):
                    found = getattr(found, name)
                else:  # a dataclass field or an annotated attribute, which has no class value
                    return name in getattr(found, "__annotations__", {})
            return True
    except ModuleNotFoundError as exc:  # a library this profile lacks: another profile checks
        if exc.name and exc.name.startswith("sparkhvd"):
            raise
        return True
    return False


def test_every_sparkhvd_reference_in_docstrings_and_docs_resolves():
    files = sorted((ROOT / "sparkhvd").rglob("*.py")) + list(PAGES)
    stale = []
    for path in files:
        text = path.read_text()
        for match in _REFERENCE.finditer(text):
            ref = re.sub(r"\s+", "", match.group(1))
            ref = (ref[ref.index("<") + 1:ref.rindex(">")] if "<" in ref else ref).lstrip("~")
            if ref.startswith("sparkhvd") and not _resolves(ref):
                stale.append(f"{path.relative_to(ROOT)}:{text[:match.start()].count(chr(10)) + 1}"
                             f": {ref}")
    assert not stale, "references to names that no longer exist:\n" + "\n".join(stale)
