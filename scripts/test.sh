#!/usr/bin/env bash
# Set up everything on a fresh clone and run the whole test suite:
#   1. .venv with zio-spark and test extras (scripts/setup.sh)
#   2. .venv-draft with a draft-API pyzmq (scripts/build-draft-pyzmq.sh), so the
#      CLIENT/SERVER socket path is tested on every run, not only the stock wheel's
#   3. ruff (check + format), mypy strict, pytest (stock pyzmq), the standalone-cluster
#      test (-m cluster: a master and two workers as separate processes), then on the draft build
#      with ZIO_REQUIRE_DRAFT=1 (draft tests fail, never skip): tests/transport and
#      tests/peers whole, and every Spark test marked requires_draft (source and sink
#      over real CLIENT/SERVER sockets)
# Extra arguments go to the main pytest run.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

bash scripts/setup.sh
bash scripts/build-draft-pyzmq.sh

echo "== ruff"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
echo "== mypy"
.venv/bin/mypy
echo "== pytest (stock pyzmq $(.venv/bin/python -c 'import zmq; print(zmq.__version__)'))"
ZIO_REQUIRE_PYRE=1 .venv/bin/python -m pytest --cov=zio_spark.protocol --cov-branch --cov-report=term \
  --cov-fail-under=95 "$@"
echo "== pytest -m cluster (standalone master + 2 workers, separate processes; needs root)"
.venv/bin/python -m pytest -p no:cacheprovider -m cluster tests/cluster
echo "== pytest tests/transport tests/peers + Spark requires_draft (draft pyzmq)"
ZIO_REQUIRE_DRAFT=1 .venv-draft/bin/python -m pytest -p no:cacheprovider \
  tests/transport $( [ -d tests/peers ] && echo tests/peers )
ZIO_REQUIRE_DRAFT=1 .venv-draft/bin/python -m pytest -p no:cacheprovider \
  -m "requires_draft and not fuzz and not chaos" tests/spark
