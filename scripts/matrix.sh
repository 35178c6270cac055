#!/usr/bin/env bash
# The Spark version matrix: the contract tests (tests/compat) on the newest pyspark of
# each older line that zio-spark supports, and the built wheel installed beside each.
#
#   bash scripts/matrix.sh              # 4.0.5, 4.1.4, 4.2.1: contract + wheel; 4.3: wheel
#   bash scripts/matrix.sh 4.1.4        # only these versions (contract + wheel)
#   MATRIX_WHEEL=0 bash scripts/matrix.sh   # contract tests only
#
# The full suite runs on 4.3 (.venv); here each older line runs the tests that define
# the contract: a stream, availableNow with the producer in another process, a batch
# read, the sink (stream and batch) and one Spark Connect round trip. Never skipped:
# every test of tests/compat must pass (a skip fails the version).
#
# Venvs: .cache/matrix/venv-<version>, with pyspark[connect]==<version>, pytest and
# zio-spark (editable), cached between runs like .venv-draft: rebuilt only when what
# defines them changes (the version, the requirement list below, this Python, the
# project's dependencies in pyproject.toml). Each venv's pyspark.zip is precompiled
# (`python -m zio_spark.cli.precompile`; Spark gives a fresh worker 10 s to connect back).
#
# The wheel (python -m build: a wheel and an sdist into .cache/matrix/dist) goes into a
# fresh venv per version that holds only that pyspark (from pip's cache), which must be
# untouched afterwards; a small stream then runs there (tests/install/wheel_stream.py).
#
# Output: one line per version and check, then "matrix: N passed, M failed".
# Exit status: non-zero if anything failed.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

py=${PYTHON:-python3}
versions=("$@")
wheel_only=()
if [ ${#versions[@]} -eq 0 ]; then
  versions=(4.0.5 4.1.4 4.2.1)
  wheel_only=(4.3.0)  # the full suite covers 4.3's contract (.venv)
fi
cache=$root/.cache/matrix
logs=$cache/logs
mkdir -p "$cache" "$logs"
exec 9>"$cache/.lock"
command -v flock >/dev/null && flock 9

# What defines a matrix venv besides its pyspark version.
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

deps_hash() {
  "$py" - "$1" "${REQS[*]}" <<'EOF'
import hashlib, sys, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
key = [sys.argv[1], sys.argv[2], sys.version, *sorted(project["dependencies"]), "v1"]
print(hashlib.sha256("\n".join(key).encode()).hexdigest())
EOF
}

# Precompile a venv's pyspark.zip if the project has the command (helper D's doctor work).
precompile() {
  local vpy=$1
  if "$vpy" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("zio_spark.cli.precompile") is None)' 2>/dev/null; then
    "$vpy" -m zio_spark.cli.precompile >>"$logs/precompile.log" 2>&1 \
      || note "warning: precompile failed in $vpy (see $logs/precompile.log)"
  else
    note "zio_spark.cli.precompile not found: pyspark.zip left as shipped"
  fi
}

# setup_venv VERSION -> sets $vpy; the venv is cached by deps_hash.
setup_venv() {
  local v=$1 venv=$cache/venv-$1 want stamp
  want=$(deps_hash "$v")
  stamp=$venv/.zio-matrix-stamp
  vpy=$venv/bin/python
  if [ -x "$vpy" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    return 0
  fi
  note "building $venv (pyspark[connect]==$v, zio-spark editable)"
  rm -rf "$venv"
  "$py" -m venv "$venv" || return 1
  "$vpy" -m pip install -q --disable-pip-version-check "pyspark[connect]==$v" "${REQS[@]}" \
    >"$logs/pip-$v.log" 2>&1 || { tail -n 20 "$logs/pip-$v.log"; return 1; }
  # --no-deps for the project would miss pyzmq/pyarrow...; pip keeps the pyspark above
  # (zio-spark does not depend on pyspark).
  "$vpy" -m pip install -q --disable-pip-version-check -e . \
    --config-settings editable_mode=compat >>"$logs/pip-$v.log" 2>&1 \
    || { tail -n 20 "$logs/pip-$v.log"; return 1; }
  [ "$("$vpy" -c 'import pyspark; print(pyspark.__version__)')" = "$v" ] \
    || { note "pip replaced pyspark $v in $venv"; return 1; }
  echo "$want" >"$stamp"
}

contract() {
  local v=$1 out=$logs/contract-$v.log
  local t0=$SECONDS
  if ! setup_venv "$v"; then
    result FAIL "$v contract: venv setup failed (see $logs/pip-$v.log)"
    return
  fi
  precompile "$vpy"  # quick once done (the command checks first)
  note "$v: pytest tests/compat (log: $out)"
  # -rs lists skips; a skipped contract test is a failure here.
  "$vpy" -m pytest -p no:cacheprovider -q -rs -m compat tests/compat >"$out" 2>&1
  local rc=$? line
  line=$(grep -E '^(=+ )?[0-9]+ (passed|failed)|(passed|failed|error).* in [0-9.]+s' "$out" | tail -n 1)
  if [ $rc -eq 0 ] && ! grep -qE '[0-9]+ skipped' <<<"$line"; then
    result OK "$v contract: $line ($((SECONDS - t0)) s)"
  else
    tail -n 40 "$out"
    result FAIL "$v contract: ${line:-pytest exit $rc} ($((SECONDS - t0)) s)"
  fi
}

built=0
build_dist() {
  [ $built = 1 ] && return 0
  rm -rf "$cache/dist"
  # The build runs in .venv (its test extras bring `build`).
  if ! "$root/.venv/bin/python" -m build --outdir "$cache/dist" >"$logs/build.log" 2>&1; then
    tail -n 20 "$logs/build.log"
    return 1
  fi
  built=1
}

wheel() {
  local v=$1 out=$logs/wheel-$v.log t0=$SECONDS
  if ! build_dist; then
    result FAIL "$v wheel: python -m build failed (see $logs/build.log)"
    return
  fi
  local whl
  whl=$(ls "$cache"/dist/zio_spark-*.whl | head -n 1)
  if bash "$root/tests/install/wheel_check.sh" "$v" "$whl" "$cache/wheel-venv-$v" >"$out" 2>&1; then
    result OK "$v wheel: $(tail -n 1 "$out") ($((SECONDS - t0)) s)"
  else
    tail -n 30 "$out"
    result FAIL "$v wheel: $(tail -n 1 "$out") ($((SECONDS - t0)) s; log: $out)"
  fi
}

for v in "${versions[@]}"; do
  contract "$v"
  [ "${MATRIX_WHEEL:-1}" = 1 ] && wheel "$v"
done
if [ "${MATRIX_WHEEL:-1}" = 1 ]; then
  for v in "${wheel_only[@]}"; do wheel "$v"; done
fi

echo "== matrix summary"
for s in "${summary[@]}"; do echo "  $s"; done
echo "matrix: $passed passed, $failed failed"
[ $failed -eq 0 ]
