#!/usr/bin/env bash
# Set up everything on a fresh clone and run the whole test suite:
#   1. .venv with zio-spark and test extras (scripts/setup.sh; precompiles pyspark.zip)
#   2. .venv-draft with a draft-API pyzmq (scripts/build-draft-pyzmq.sh), so the
#      CLIENT/SERVER socket path is tested on every run, not only the stock wheel's
#   3. the passes: ruff (check + format), mypy strict, pytest (stock pyzmq), the
#      standalone-cluster test (-m cluster: a master and two workers as separate
#      processes), then on the draft build with ZIO_REQUIRE_DRAFT=1 (draft tests fail, never
#      skip): the tests of tests/loopback and tests/peers whose code path depends on the
#      draft API (marked requires_draft: CLIENT/SERVER sockets; or draft_path: a branch taken
#      only when libzmq has it), and every Spark test marked requires_draft (source and
#      sink over real CLIENT/SERVER sockets). The other loopback tests run ROUTER/DEALER,
#      the same code on either build: the main pytest pass has them. Then the Spark
#      version matrix (scripts/matrix.sh: contract tests on pyspark 4.0, 4.1, 4.2)
# Every pass runs even when an earlier one failed; a summary line per pass (name, result,
# seconds) ends the output, and the exit status is non-zero if any pass failed.
# Extra arguments go to the main pytest run. Not run here (by hand): -m bench (the full
# `zio-spark bench --quick`), -m fuzz, -m chaos.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

# Without these two nothing below can run: stop here, loudly.
bash scripts/setup.sh || { echo "test.sh: scripts/setup.sh failed" >&2; exit 1; }
bash scripts/build-draft-pyzmq.sh || { echo "test.sh: scripts/build-draft-pyzmq.sh failed" >&2; exit 1; }

SUMMARY=()
FAILED=0
FAILED_LOGS=()
logs=$root/.cache/test-logs  # absolute: the matrix runs pytest in other folders
rm -rf "$logs" && mkdir -p "$logs"
# pass NAME CMD...: run one pass, record its result and duration; never stops the script.
# Its output also goes to .cache/test-logs/N.log, so the summary can repeat what a failed
# pass said at its start (a crash's first lines scroll away above a long thread dump).
pass() {
  local name=$1 t0=$SECONDS rc log
  shift
  log=$logs/$((${#SUMMARY[@]} + 1)).log
  echo
  echo "== $name"
  ZIO_TEST_CURRENT_FILE=$log.current "$@" 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  if ((rc == 0)); then
    SUMMARY+=("$(printf '%-28s ok      %5ss' "$name" $((SECONDS - t0)))")
  else
    FAILED=$((FAILED + 1))
    FAILED_LOGS+=("$name|$log")
    SUMMARY+=("$(printf '%-28s FAILED  %5ss  (exit %s)' "$name" $((SECONDS - t0)) "$rc")")
  fi
}

# failure_digest NAME LOG: the lines of a failed pass worth seeing at the end of the output:
# its FAILED/ERROR lines, and the start of a fatal error (the crashing thread's stack).
failure_digest() {
  echo "-- $1 (whole output: $2)"
  grep -E '^(FAILED|ERROR) ' "$2" | head -20
  if [ -s "$2.current" ] && grep -q -E 'Fatal Python error' "$2"; then
    echo "the process died in: $(cat "$2.current")"
  fi
  grep -m1 -A30 -E 'Fatal Python error' "$2"
}

start=$SECONDS
zmq_version=$(.venv/bin/python -c 'import zmq; print(zmq.__version__)')
pass "ruff check" .venv/bin/ruff check .
pass "ruff format --check" .venv/bin/ruff format --check .
pass "mypy" .venv/bin/mypy
pass "pytest (pyzmq $zmq_version)" env ZIO_REQUIRE_PYRE=1 .venv/bin/python -m pytest \
  --cov=zio_spark.protocol --cov-branch --cov-report=term --cov-fail-under=95 "$@"
pass "pytest -m cluster" .venv/bin/python -m pytest -p no:cacheprovider -m cluster tests/cluster
draft_dirs=(tests/loopback)
[ -d tests/peers ] && draft_dirs+=(tests/peers)
pass "draft: transport+peers" env ZIO_REQUIRE_DRAFT=1 .venv-draft/bin/python -m pytest \
  -p no:cacheprovider "${draft_dirs[@]}" \
  -m "(requires_draft or draft_path) and not fuzz and not chaos and not load and not bench"
pass "draft: Spark requires_draft" env ZIO_REQUIRE_DRAFT=1 .venv-draft/bin/python -m pytest \
  -p no:cacheprovider -m "requires_draft and not fuzz and not chaos and not load" tests/spark
pass "matrix (older Spark lines)" bash scripts/matrix.sh

echo
echo "== summary ($((SECONDS - start)) s, $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg))"
printf '%s\n' "${SUMMARY[@]}"
if ((FAILED)); then
  echo
  echo "== what the failed passes said"
  for entry in "${FAILED_LOGS[@]}"; do failure_digest "${entry%%|*}" "${entry#*|}"; done
  echo "test.sh: $FAILED of ${#SUMMARY[@]} passes FAILED"
  exit 1
fi
echo "test.sh: all ${#SUMMARY[@]} passes ok"
