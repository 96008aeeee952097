"""The suite's own clock: what each test costs, a limit per test, and the slowest at the end.

CI has a fixed budget (``.ci/run``: every profile from a fresh clone in 45 minutes), and every
new test spends some of it. So the suite guards itself:

- a test whose own time (its setup, call and teardown, less starting the shared fixtures it
  happened to need first, such as the session's SparkSession) passes :data:`LIMIT_S` fails with
  its name and time, unless it carries ``@pytest.mark.long("why it needs longer")``: a guard on
  the suite, not a timing assert on the product (the hang guards are pytest-timeout's);
- the run ends with the profile's total and its slowest tests (wall time, shared fixtures
  included), so a test that grows shows up in the CI log of the change that made it grow.

Works alone and under pytest-xdist: the limit is judged where the test runs, the summary is
written where the reports arrive. Loaded by tests/conftest.py; the profile's name comes from
``SPARKHVD_TEST_PROFILE`` (the Makefile sets it).
"""
from __future__ import annotations

import os
import time

import pytest

#: A test's own seconds above which it fails unless marked ``long`` (see the module docstring);
#: ``SPARKHVD_TEST_LIMIT_S`` sets another (the guard's own test uses a fraction of a second).
LIMIT_S = float(os.environ.get("SPARKHVD_TEST_LIMIT_S", "120"))
#: How many of the slowest tests the run ends with.
SLOWEST = 15

_SHARED = "suite_clock_shared_s"  # a report's user property: shared fixtures it started
_LONG = "suite_clock_long"

#: where the test runs: nodeid -> {"setup"/"call"/"teardown"/"shared": seconds, "long": 0|1}
_running: dict[str, dict[str, float]] = {}
_current: list[str] = []
#: where the reports arrive: nodeid -> the same, from the reports
_reported: dict[str, dict[str, float]] = {}
_started = time.monotonic()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", f"long(reason): this test needs more than {LIMIT_S:.0f} s of its own, and "
                   "says why (tests/suite_clock.py fails an unmarked one)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    _current.append(item.nodeid)
    _running[item.nodeid] = {"setup": 0.0, "call": 0.0, "teardown": 0.0, "shared": 0.0,
                             "long": float(item.get_closest_marker("long") is not None)}
    try:
        yield
    finally:
        _current.pop()
        _running.pop(item.nodeid, None)


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef: pytest.FixtureDef, request: pytest.FixtureRequest):
    """Time the setup of fixtures shared by several tests: whichever test starts one first is
    not charged with it."""
    began = time.monotonic()
    yield
    if fixturedef.scope != "function" and _current and _current[-1] in _running:
        _running[_current[-1]]["shared"] += time.monotonic() - began


def _own_seconds(times: dict[str, float]) -> float:
    return max(0.0, times["setup"] + times["call"] + times["teardown"] - times["shared"])


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    times = _running.get(item.nodeid)
    if times is None:
        return
    times[call.when] = call.duration
    report.user_properties = [*report.user_properties, (_SHARED, times["shared"]),
                              (_LONG, times["long"])]
    # Judged once the test's own time is known: after the call, and again after the teardown
    # (a slow fixture teardown); a failed test is not failed a second time.
    if call.when not in ("call", "teardown") or not report.passed or times["long"] \
            or times.get("flagged"):
        return
    seconds = _own_seconds(times)
    if seconds > LIMIT_S:
        times["flagged"] = 1.0
        report.outcome = "failed"
        report.longrepr = (
            f"{item.nodeid} took {seconds:.0f} s of its own (setup {times['setup']:.0f} s, "
            f"call {times['call']:.0f} s, teardown {times['teardown']:.0f} s, less "
            f"{times['shared']:.0f} s starting shared fixtures): over the suite's limit of "
            f"{LIMIT_S:.0f} s a test. Make it wait for conditions and set its timers short, or "
            "mark it @pytest.mark.long(\"why it needs longer\") (tests/suite_clock.py).")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    times = _reported.setdefault(report.nodeid, {"setup": 0.0, "call": 0.0, "teardown": 0.0,
                                                 "shared": 0.0, "long": 0.0})
    times[report.when] = report.duration
    props = dict(report.user_properties)
    times["shared"] = float(props.get(_SHARED, times["shared"]))
    times["long"] = float(props.get(_LONG, times["long"]))


def pytest_unconfigure(config: pytest.Config) -> None:
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None or not _reported or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    profile = os.environ.get("SPARKHVD_TEST_PROFILE", "(no profile)")
    walls = {nodeid: t["setup"] + t["call"] + t["teardown"] for nodeid, t in _reported.items()}
    reporter.write_sep("=", f"suite clock, profile {profile}")
    reporter.write_line(f"the {min(SLOWEST, len(walls))} slowest tests (seconds; * marked "
                        "long; + includes starting shared fixtures):")
    for nodeid, wall in sorted(walls.items(), key=lambda kv: -kv[1])[:SLOWEST]:
        times = _reported[nodeid]
        flags = ("*" if times["long"] else " ") + ("+" if times["shared"] >= 0.05 * LIMIT_S else " ")
        reporter.write_line(f"  {wall:7.1f} {flags} {nodeid}")
    reporter.write_line(f"profile {profile}: {len(walls)} tests, {sum(walls.values()):.0f} s "
                        f"in tests, {time.monotonic() - _started:.0f} s from start to end")
