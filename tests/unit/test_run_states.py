"""The run's states (sparkhvd.driver.states): what each carries into run.json, and one picture
of which state follows which -- in the states module, run.py and the architecture page."""
from __future__ import annotations

import pathlib
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
