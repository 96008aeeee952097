"""How ranks are started: one :class:`LaunchSpec`, one small interface (:class:`WorkerGroup`:
start, poll -- what was seen of each rank, as :class:`RankFact` data -- and shutdown), three
launchers -- each its group's class (``barrier``, ``horovod``, ``local``; the table is in
:mod:`~sparkhvd.driver.launchers.seam`) -- and the one table of rules that decides which
launcher a run may use (:mod:`~sparkhvd.driver.launchers.rules`). This face only hands names
on.
"""
from sparkhvd.driver.launchers.rules import (
    MODULES,
    RULES,
    LaunchFacts,
    check_launch,
    choose_launcher,
    get_launcher,
)
from sparkhvd.driver.launchers.seam import (
    GroupStatus,
    Launcher,
    LaunchSpec,
    Placement,
    RankFact,
    RankReach,
    Sink,
    WorkerGroup,
)

__side__ = "driver"

__all__ = ["MODULES", "RULES", "LaunchFacts", "check_launch", "choose_launcher", "get_launcher",
           "GroupStatus", "Launcher", "LaunchSpec", "Placement", "RankFact", "RankReach", "Sink",
           "WorkerGroup"]
