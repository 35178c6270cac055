#!/usr/bin/env bash
# The reliability (chaos) suite of tests/reliability at full size: 1M records through the
# source (spool and readMode=direct), the sink and the queue while drivers, producers and
# the queue are SIGKILLed and restarted, and 200k messages through the queue read with
# readMode=direct while the queue is SIGKILLed (tests/spark/test_queue_direct.py); the
# CI-sized versions run in the normal suite. ~15-20 min on 2 cores.
#
#   bash scripts/chaos.sh                       # a fresh random seed per test (printed)
#   ZIO_CHAOS_SEED=1234 bash scripts/chaos.sh   # replay the kill moments of a failed run
#   bash scripts/chaos.sh -k queue              # extra arguments go to pytest
#   bash scripts/chaos.sh -k direct             # readMode=direct only (source and queue)
#
# Loopback only; every child process is killed and reaped by the tests themselves.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
export SPARK_LOCAL_IP=127.0.0.1
export PYSPARK_PYTHON="$root/.venv/bin/python"
export PYSPARK_DRIVER_PYTHON="$root/.venv/bin/python"
exec .venv/bin/python -m pytest -m chaos tests/reliability tests/spark/test_queue_direct.py \
  -v -s -p no:cacheprovider "$@"
