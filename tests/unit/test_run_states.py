"""The run's states (sparkhvd.driver.states): what each carries into run.json, and one picture
of which state follows which -- in the states module, run.py and the architecture page."""
from __future__ import annotations

import pathlib
import re
from types import SimpleNamespace

import pytest

from sparkhvd.driver import states
from sparkhvd.driver.states import (
    NEXT,
    Failed,
    Finished,
    Placing,
    Resizing,
    Restarting,
    Running,
    diagram,
)

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("where", ["sparkhvd/driver/states.py", "sparkhvd/driver/run.py",
                                   "docs/architecture.md"])
def test_every_picture_of_the_states_is_the_one_next_defines(where):
    text = (ROOT / where).read_text()
    lines = [line.strip() for line in text.splitlines()]
    picture = diagram().splitlines()
    at = lines.index(picture[0])
    assert lines[at:at + len(picture)] == picture, f"{where}: redraw it from states.diagram()"


def test_each_state_says_in_run_json_what_it_always_said():
    """run.json's states entries keep their fields (nothing changes for users)."""
    attempt = SimpleNamespace(number=2, size=3)
    assert Placing("the run starts", size=4).entry() == {"size": 4}
    assert Running("attempt 2 launches 3 rank(s)", attempt=attempt).entry() == \
        {"attempt": 2, "size": 3}
    relaunch = dict(attempt=attempt, checkpoint="epoch-0001.pt", size_from=3, size_to=2)
    assert Resizing("lost", **relaunch).entry() == \
        {"attempt": 2, "checkpoint": "epoch-0001.pt", "from": 3, "to": 2}
    assert Restarting("lost", **relaunch).label == "restarting"
    assert Finished("done").entry() == {} and Failed("x").entry() == {}


def test_the_terminal_states_lead_nowhere_and_every_other_state_leads_somewhere():
    kinds = [c for c in vars(states).values()
             if isinstance(c, type) and issubclass(c, states.RunState) and c.label != "?"]
    ends = {Finished, Failed}  # where the run ends: nothing follows them
    assert {c for c in kinds if c not in ends} == set(NEXT)
    assert not ends & set(NEXT)
    assert all(Failed in nexts for nexts in NEXT.values())


def _walk() -> list[tuple[str, str, list[str]]]:
    """The architecture page's walk of one run: (step, file, names) per row of its table."""
    text = (ROOT / "docs/architecture.md").read_text()
    section = text.split("## A run in ten files", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[1].startswith("`"):
            rows.append((cells[0], cells[1].strip("`"),
                         [n.strip().strip("`") for n in cells[2].split(",")]))
    return rows


def test_the_walk_of_one_run_is_ten_files_that_hold_what_it_names():
    """docs/architecture.md names, for the call, the start, a poll, a failure, a retry and the
    result, the file where it happens: every file exists and holds each name (a class and its
    method, or a function), and together they are no more than ten."""
    rows = _walk()
    assert {step for step, _, _ in rows} == {"call", "start", "poll", "a failure", "a retry",
                                             "the result"}
    files = {path for _, path, _ in rows}
    assert len(files) <= 10, sorted(files)
    for _, path, names in rows:
        source = (ROOT / "sparkhvd" / path).read_text()
        for name in names:
            owner, _, member = name.rpartition(".")
            if owner:
                found = re.search(rf"^class {owner}\b[(:]", source, re.M)
                assert found, f"{path} has no class {owner}"
                body = source[found.end():].split("\nclass ", 1)[0]
                assert f"def {member}(" in body, f"{path}: {owner} has no {member}"
            else:
                assert f"def {name}(" in source or f"class {name}" in source, \
                    f"{path} holds no {name}"
