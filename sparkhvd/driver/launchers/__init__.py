"""How ranks are started: one :class:`LaunchSpec`, one small protocol, three launchers, and the
one table of rules that decides which launcher a run may use (:data:`RULES`).

Every launcher takes the same :class:`LaunchSpec` and a *sink* (the attempt's
:class:`~sparkhvd.driver.inbox.AttemptInbox`, which receives every
:mod:`sparkhvd.common.protocol` message the ranks send), starts the ranks and returns their
:class:`RankGroup`, which the controller polls until it gives the ranks' return values in rank
order -- or raises :class:`~sparkhvd.common.errors.LaunchFailure` (a rank failed); whatever
ends the polling early (a failure, ``TimeoutError``, ``KeyboardInterrupt``) stops every rank
first:

============  ==================================================================================
``barrier``   the default on Spark: one barrier stage, a control connection per task, one
              supervised rank process per task (:mod:`sparkhvd.driver.launchers.barrier`)
``horovod``   ``horovod.spark.run`` / ``run_elastic``: elastic runs, and sessions with dynamic
              allocation, which barrier stages cannot use (:mod:`~.launchers.horovod_spark`); horovod
              starts the ranks itself, in its own task processes
``local``     ``np < 0``: supervised rank processes on the driver (:mod:`~.launchers.local`)
============  ==================================================================================

The shared lifecycle -- the launch's blocking call in a helper thread the controller polls,
aborting, cancelling the Spark job, killing what is left -- lives in
:mod:`sparkhvd.driver.launchers.base`; the barrier and local launchers start each rank as a
:class:`sparkhvd.common.rankprocess.RankProcess`. This face only hands names on:
:mod:`~sparkhvd.driver.launchers.seam` (what a launch is given and hands back) and
:mod:`~sparkhvd.driver.launchers.rules` (which launcher a run may use).
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
    Launcher,
    LaunchSpec,
    Placement,
    RankGroup,
    Sink,
    left_until,
)

__side__ = "driver"

__all__ = ["MODULES", "RULES", "LaunchFacts", "check_launch", "choose_launcher", "get_launcher",
           "Launcher", "LaunchSpec", "Placement", "RankGroup", "Sink", "left_until"]
