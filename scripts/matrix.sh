#!/usr/bin/env bash
# The Spark version matrix: the built wheel installed next to each supported pyspark
# line, and the contract tests (tests/compat) run there against the installed wheel.
#
#   bash scripts/matrix.sh                 # 4.0.5, 4.1.4, 4.2.1: whole contract; 4.3.0: a stream;
#                                          # 4.1.4 also: the quickstart notebook through Connect
#   bash scripts/matrix.sh 4.1.4 4.3.0     # only these (each runs the whole contract)
#
# For each version X:
# 1. a base venv with only pyspark[connect]==X and the test runner (pytest, pandas),
#    cached in .cache/matrix/base-X and rebuilt only when what defines it changes (the
#    version, the requirement list below, this Python);
# 2. a fresh copy of it (.cache/matrix/run-X) gets the wheel (python -m build: a wheel and
#    an sdist into .cache/matrix/dist, once per run of this script) and its dependencies
#    with pip; pyspark must be untouched (version, RECORD, every file and its size);
# 3. the wheel's own `python -m zio_spark.cli.precompile` (Spark gives a fresh Python
#    worker 10 s to connect back);
# 4. pytest -m compat on a copy of tests/ in a temp folder, so that zio_spark can only
#    come from the installed wheel (the test checks the driver's and the workers'):
#    a stream, availableNow with the producer in another process, a batch read, the sink
#    (stream and batch), a Spark Connect round trip, the maxRecordsPerTrigger rule,
#    readMode=direct (tests/compat/test_direct.py).
#    Every test must pass: a skip fails the version. The full suite covers 4.3 (.venv),
#    so 4.3.0 runs the probes and one stream here, against the wheel.
# Steps 1-3 of the next version (and the copy of tests/) run in the background while step 4
# of this one runs: only the first version's preparation is waited for.
#
# Output: one line per version, then "matrix: N passed, M failed". Exit non-zero if any
# version failed. Logs: .cache/matrix/logs/.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

py=${PYTHON:-python3}
declare -A only=()
versions=("$@")
# Versions that also run the quickstart notebook through a Spark Connect session (the
# Databricks serverless line; the full suite runs it on 4.3).
declare -A notebook=([4.1.4]=1)
if [ ${#versions[@]} -eq 0 ]; then
  versions=(4.0.5 4.1.4 4.2.1 4.3.0)
  only[4.3.0]="probes or workers or stream_every_record"
fi
cache=$root/.cache/matrix
logs=$cache/logs
mkdir -p "$cache" "$logs"
exec 9>"$cache/.lock"
command -v flock >/dev/null && flock 9

# What a base venv holds besides pyspark[connect]==X (the contract tests' runner).
REQS=("pandas>=2.2.0,<3" "pytest>=8" "pytest-timeout>=2.3")

summary=()
failed=0
passed=0
note() { printf '[matrix %4ss] %s\n' "$SECONDS" "$*"; }
result() {  # result OK|FAIL text
  summary+=("$1 $2")
  if [ "$1" = OK ]; then passed=$((passed + 1)); else failed=$((failed + 1)); fi
  note "$1 $2"
}

base_venv() {  # base_venv X -> $base (cached)
  local v=$1 want
  base=$cache/base-$v
  want=$(printf '%s\n' "$v" "${REQS[@]}" "$("$py" -c 'import sys; print(sys.version)')" v1 \
    | sha256sum | cut -d' ' -f1)
  if [ -x "$base/bin/python" ] && [ "$(cat "$base/.zio-matrix-stamp" 2>/dev/null)" = "$want" ]; then
    return 0
  fi
  note "building $base (pyspark[connect]==$v, ${REQS[*]})"
  rm -rf "$base"
  "$py" -m venv "$base" || return 1
  "$base/bin/python" -m pip install -q --disable-pip-version-check "pyspark[connect]==$v" \
    "${REQS[@]}" >"$logs/base-$v.log" 2>&1 || { tail -n 20 "$logs/base-$v.log"; return 1; }
  echo "$want" >"$base/.zio-matrix-stamp"
}

snapshot() {  # pyspark's version, its RECORD's hash, every file with its size (hashed)
  "$1" - <<'PY'
import hashlib, importlib.metadata as md, os
d = md.distribution("pyspark")
top = os.path.dirname(str(d.locate_file("pyspark/__init__.py")))
files = []
for dirpath, dirs, names in os.walk(top):
    dirs[:] = [x for x in dirs if x != "__pycache__"]
    files += [f"{os.path.relpath(os.path.join(dirpath, n), top)} "
              f"{os.path.getsize(os.path.join(dirpath, n))}" for n in names]
files.sort()
print(d.version, hashlib.sha256((d.read_text("RECORD") or "").encode()).hexdigest()[:12],
      len(files), hashlib.sha256("\n".join(files).encode()).hexdigest()[:12])
PY
}

built=0
build_dist() {
  [ $built = 1 ] && return 0
  rm -rf "$cache/dist"
  # The build runs in .venv (its test extras bring `build`).
  "$root/.venv/bin/python" -m build --outdir "$cache/dist" >"$logs/build.log" 2>&1 \
    || { tail -n 20 "$logs/build.log"; return 1; }
  ls "$cache"/dist/zio_spark-*.whl "$cache"/dist/zio_spark-*.tar.gz >/dev/null || return 1
  grep -qi "deprecat" "$logs/build.log" && note "warning: the build printed a deprecation (see $logs/build.log)"
  built=1
}

# prepare X: everything before the tests (base venv, copy, wheel, pyspark check, precompile,
# the tests' copy, the notebook's kernel packages), into .cache/matrix/prep-X: "OK <wheel
# install s> <work folder> <s>" or "FAIL <why>". Its output goes to the version's log. It
# runs in the background while the previous version's tests run (no two pips at once:
# the tests install nothing), so only the first version's preparation is waited for.
prepare() {
  local v=$1
  local log=$logs/matrix-$v.log t0=$SECONDS run=$cache/run-$v status=$cache/prep-$v
  : >"$log"
  rm -f "$status"
  fail() { echo "FAIL $*" >"$status"; }
  base_venv "$v" || { fail "$v: base venv failed (see $logs/base-$v.log)"; return; }
  rm -rf "$run"
  cp -a "$base" "$run" || { fail "$v: cannot copy $base"; return; }
  local vpy=$run/bin/python whl before after t1 t_wheel
  whl=$(ls "$cache"/dist/zio_spark-*.whl | head -n 1)
  before=$(snapshot "$vpy")
  t1=$SECONDS
  if ! "$vpy" -m pip install -q --disable-pip-version-check "$whl" >>"$log" 2>&1; then
    fail "$v: pip install $(basename "$whl") failed (see $log)"
    return
  fi
  t_wheel=$((SECONDS - t1))
  after=$(snapshot "$vpy")
  echo "pyspark before the wheel: $before; after: $after" >>"$log"
  if [ "$before" != "$after" ] || [ "${before%% *}" != "$v" ]; then
    fail "$v: installing the wheel changed pyspark ($before -> $after)"
    return
  fi
  "$vpy" -m zio_spark.cli.precompile >>"$log" 2>&1 \
    || { fail "$v: python -m zio_spark.cli.precompile failed (see $log)"; return; }
  local work
  work=$(mktemp -d)
  cp -r "$root/tests" "$root/notebooks" "$root/pyproject.toml" "$work/"
  find "$work/tests" -name __pycache__ -prune -exec rm -rf {} +
  if ! (cd "$work" && env -u PYTHONPATH "$vpy" -c \
      'import sys, zio_spark; assert zio_spark.__file__.startswith(sys.prefix), zio_spark.__file__') \
      >>"$log" 2>&1; then
    rm -rf "$work"
    fail "$v: zio_spark does not come from the installed wheel (see $log)"
    return
  fi
  if [ -n "${notebook[$v]:-}" ] \
    && ! "$vpy" -m pip install -q --disable-pip-version-check nbclient nbformat ipykernel \
      >>"$log" 2>&1; then
    rm -rf "$work"
    fail "$v: pip install of the notebook's kernel packages failed (see $log)"
    return
  fi
  echo "OK $t_wheel $work $((SECONDS - t0))" >"$status"
}

# run_tests X: the contract tests (and the notebook) in the folder prepare X made.
run_tests() {
  local v=$1
  local log=$logs/matrix-$v.log t0=$SECONDS run=$cache/run-$v state
  state=$(cat "$cache/prep-$v" 2>/dev/null || echo "FAIL $v: its preparation ended without a word")
  rm -f "$cache/prep-$v"
  if [ "${state%% *}" != OK ]; then
    result FAIL "${state#FAIL }"
    return
  fi
  local t_wheel work t_prep
  read -r _ t_wheel work t_prep <<<"$state"
  local vpy=$run/bin/python k=() line rc
  [ -n "${only[$v]:-}" ] && k=(-k "${only[$v]}")
  # PYSPARK_PYTHON unset: the tests point Spark's workers at this venv's python.
  (cd "$work" && env -u PYSPARK_PYTHON -u PYSPARK_DRIVER_PYTHON -u PYTHONPATH \
    "$vpy" -m pytest -p no:cacheprovider -q -rs -m compat "${k[@]}" tests/compat) >>"$log" 2>&1
  rc=$?
  line=$(grep -E '[0-9]+ (passed|failed)' "$log" | tail -n 1)
  local nb_line=""
  if [ $rc -eq 0 ] && [ -n "${notebook[$v]:-}" ]; then
    # The notebook as on serverless: a given Spark Connect session, this pyspark.
    if (cd "$work" && env -u PYSPARK_PYTHON -u PYSPARK_DRIVER_PYTHON -u PYTHONPATH \
        "$vpy" -m pytest -p no:cacheprovider -q -rs \
        tests/notebooks/test_quickstart.py::test_quickstart_runs_with_a_given_spark_connect_session) \
        >>"$log" 2>&1; then
      nb_line="; notebook through Spark Connect: $(grep -E '[0-9]+ passed' "$log" | tail -n 1 | tr -d '=')"
      grep -E '[0-9]+ passed' "$log" | tail -n 1 | grep -q skipped && rc=1
    else
      rc=1
    fi
  fi
  rm -rf "$work"
  if [ $rc -eq 0 ] && ! grep -qE '[0-9]+ (skipped|deselected.*skipped)' <<<"$line"; then
    result OK "$v: prepared in ${t_prep} s (wheel installed in ${t_wheel} s), pyspark untouched; ${line//=/}${nb_line} (tests $((SECONDS - t0)) s)"
  else
    tail -n 40 "$log"
    result FAIL "$v: ${line:-pytest exit $rc} (tests $((SECONDS - t0)) s; log $log)"
  fi
}

if build_dist; then
  prepare "${versions[0]}"
  for i in "${!versions[@]}"; do
    next=${versions[$((i + 1))]:-}
    prep_pid=""
    if [ -n "$next" ]; then
      prepare "$next" &
      prep_pid=$!
    fi
    run_tests "${versions[$i]}"
    [ -n "$prep_pid" ] && wait "$prep_pid"
  done
else
  for v in "${versions[@]}"; do result FAIL "$v: python -m build failed (see $logs/build.log)"; done
fi

echo "== matrix summary"
for s in "${summary[@]}"; do echo "  $s"; done
echo "matrix: $passed passed, $failed failed"
[ $failed -eq 0 ]
