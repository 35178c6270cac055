#!/usr/bin/env bash
# Create .venv at the repo root and install zio-spark with its test extras.
# Idempotent: re-installs only when pyproject.toml changed since the last run.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

py=${PYTHON:-python3}
if ! command -v "$py" >/dev/null 2>&1; then
  echo "setup: $py not found; zio-spark needs Python >= 3.10" >&2; exit 2
fi
if ! "$py" -c 'import sys; sys.exit(sys.version_info < (3, 10))'; then
  echo "setup: $("$py" --version) is too old; zio-spark needs Python >= 3.10" >&2; exit 2
fi
if ! command -v java >/dev/null 2>&1; then
  echo "setup: java not found; Spark 4 needs Java 17 (apt-get install openjdk-17-jre-headless)" >&2
  exit 2
fi

# Bytecode for the pyspark.zip Spark puts on its Python workers' path: a fresh worker then
# imports pyspark in about half the CPU time, well inside Spark's fixed 10 s connect-back
# limit on a busy machine (issue #23). Idempotent: a check of ~1 s when already done.
precompile() {
  .venv/bin/python -m zio_spark.cli.precompile \
    || { echo "setup: could not precompile pyspark.zip (see above)" >&2; exit 1; }
}

stamp=.venv/.zio-spark-installed
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ -x .venv/bin/python ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  precompile
  exit 0
fi
echo "setup: installing zio-spark and its test dependencies into .venv (about a minute)"
[ -x .venv/bin/python ] || "$py" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test]' \
  --config-settings editable_mode=compat  # a path entry Spark's pyspark_* lookup can list
precompile
echo "$want" > "$stamp"
