"""One local[2] SparkSession for the contract tests (scripts/matrix.sh runs them on each
pyspark line; the default run leaves them to the 4.3 suite: marker ``compat``)."""

from __future__ import annotations

import pytest

from tests.support import spark_session


@pytest.fixture(scope="session")
def spark():
    session = spark_session("zio-spark-contract")
    yield session
    session.stop()
