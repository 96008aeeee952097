"""The suite's guard on itself (tests/suite_clock.py): a test over the limit fails with its name
and time unless marked ``long``; shared fixtures are charged to nobody; the run ends with the
profile's total and its slowest tests. Run in a pytest of its own, with a limit of 0.3 s."""
import os
import subprocess
import sys
import textwrap

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_test_over_the_limit_fails_unless_marked_long(tmp_path):
    (tmp_path / "conftest.py").write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {TESTS!r})
        import suite_clock

        def pytest_configure(config):
            config.pluginmanager.register(suite_clock, "suite_clock")
    """))
    (tmp_path / "test_timed.py").write_text(textwrap.dedent("""
        import threading
        import pytest

        @pytest.fixture(scope="session")
        def slow_to_start():
            threading.Event().wait(0.6)
            return 1

        def test_quick():
            pass

        def test_slow():
            threading.Event().wait(0.6)

        @pytest.mark.long("waits on purpose")
        def test_slow_and_says_why():
            threading.Event().wait(0.6)

        def test_first_to_start_the_shared_fixture(slow_to_start):
            pass
    """))
    env = {**os.environ, "SPARKHVD_TEST_LIMIT_S": "0.3", "SPARKHVD_TEST_PROFILE": "tiny"}
    env.pop("PYTEST_XDIST_WORKER", None)
    out = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q",
                          "-p", "no:xdist", str(tmp_path)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    text = out.stdout
    assert out.returncode == 1, text
    assert "1 failed, 3 passed" in text, text
    assert "test_timed.py::test_slow took 1 s of its own" in text or \
        "test_timed.py::test_slow took 0 s of its own" in text, text
    assert "over the suite's limit of 0 s a test" in text and "@pytest.mark.long" in text, text
    lines = text.splitlines()
    summary = lines.index(next(x for x in lines if "suite clock, profile tiny" in x))
    assert lines[-1].startswith("profile tiny: 4 tests"), lines[-1]
    slowest = lines[summary + 2:-1]
    assert len(slowest) == 4, slowest
    assert any("* " in x and "test_slow_and_says_why" in x for x in slowest), slowest
    assert any(" +" in x and "test_first_to_start_the_shared_fixture" in x for x in slowest), \
        slowest
