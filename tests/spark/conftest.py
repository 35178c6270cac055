"""One local[2] SparkSession for the whole Spark test suite (startup costs ~10 s)."""

from __future__ import annotations

import pytest

from tests.support import spark_session


@pytest.fixture(scope="session")
def spark():
    session = spark_session()
    yield session
    session.stop()
