"""Shared fixtures: one local-mode SparkSession (2 task slots) for the whole test session."""
from __future__ import annotations

import logging
import os

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


@pytest.fixture(scope="session")
def spark():
    """A real local[2] SparkSession on 127.0.0.1, created the way HorovodRunner creates one."""
    from sparkhvd.session import get_or_create_session

    session = get_or_create_session(2)
    yield session
    session.stop()


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def rank_lines():
    """Lines the driver shows from the ranks (what a user sees), as a list of strings."""
    from sparkhvd.logs import rank_logger

    handler = _Capture()
    rank_logger.addHandler(handler)
    yield handler.lines
    rank_logger.removeHandler(handler)
