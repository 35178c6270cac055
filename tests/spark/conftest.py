"""One local[2] SparkSession for the whole Spark test suite (startup costs ~10 s)."""

from __future__ import annotations

import pytest

from tests.support import spark_session
from zio_spark.source.producer import Producer


@pytest.fixture(scope="session")
def spark():
    session = spark_session()
    yield session
    session.stop()


@pytest.fixture
def producers(ctx):
    """``make(producer_id)``: a loopback producer (bound, any port), closed at teardown."""
    made: list[Producer] = []

    def make(producer_id: str) -> Producer:
        p = Producer(ctx=ctx, producer_id=producer_id, linger_ms=0, bind="tcp://127.0.0.1:*")
        made.append(p)
        return p

    yield make
    for p in made:
        p.close(flush=False, timeout=5)
