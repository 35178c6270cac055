#!/usr/bin/env bash
# The built wheel in a clean venv that already holds pyspark VERSION (run by
# scripts/matrix.sh, one per Spark line):
#   bash tests/install/wheel_check.sh VERSION WHEEL VENV_DIR
# 1. a fresh venv with only pyspark==VERSION (from pip's cache after the first run),
# 2. pip install WHEEL: pyspark must be untouched (version, RECORD, every file's size),
# 3. a small stream there (tests/install/wheel_stream.py), the venv's python being the
#    driver's and the workers' (PYSPARK_PYTHON), run from a temp folder so that nothing
#    but the installed wheel provides zio_spark.
# Last line: a one-line result (read by scripts/matrix.sh).
set -uo pipefail
v=$1 whl=$2 venv=$3
here=$(cd "$(dirname "$0")" && pwd)
py=${PYTHON:-python3}
fail() { echo "FAIL: $*"; exit 1; }

t0=$SECONDS
rm -rf "$venv"
"$py" -m venv "$venv" || fail "python -m venv"
vpy=$venv/bin/python
"$vpy" -m pip install -q --disable-pip-version-check "pyspark==$v" || fail "pip install pyspark==$v"
t_spark=$((SECONDS - t0))

snapshot() {  # pyspark's version, its RECORD's hash, and every file with its size
  "$vpy" - <<'PY'
import hashlib, importlib.metadata as md, os
d = md.distribution("pyspark")
root = os.path.dirname(os.path.dirname(d.locate_file("pyspark/__init__.py")))
files = []
for dirpath, dirs, names in os.walk(os.path.join(root, "pyspark")):
    dirs[:] = [x for x in dirs if x != "__pycache__"]
    for n in names:
        p = os.path.join(dirpath, n)
        files.append(f"{os.path.relpath(p, root)} {os.path.getsize(p)}")
files.sort()
record = d.read_text("RECORD") or ""
print(d.version, hashlib.sha256(record.encode()).hexdigest()[:16], len(files),
      hashlib.sha256("\n".join(files).encode()).hexdigest()[:16])
PY
}
before=$(snapshot) || fail "pyspark snapshot"
t1=$SECONDS
"$vpy" -m pip install -q --disable-pip-version-check "$whl" || fail "pip install $(basename "$whl")"
t_wheel=$((SECONDS - t1))
after=$(snapshot) || fail "pyspark snapshot after"
echo "pyspark before: $before"
echo "pyspark after:  $after"
[ "$before" = "$after" ] || fail "installing the wheel changed pyspark: $before -> $after"
[ "${before%% *}" = "$v" ] || fail "pyspark is ${before%% *}, not $v"

# The wheel's own command, as a user would run it (after the check above: it rewrites
# pyspark.zip with bytecode added); a busy machine then still starts Spark's workers
# within their 10 s.
"$vpy" -m zio_spark.cli.precompile >/dev/null || fail "python -m zio_spark.cli.precompile"

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp "$here/wheel_stream.py" "$work/"
t2=$SECONDS
(cd "$work" && env -u PYTHONPATH PYSPARK_PYTHON="$vpy" PYSPARK_DRIVER_PYTHON="$vpy" \
  SPARK_LOCAL_IP=127.0.0.1 PYSPARK_SUBMIT_ARGS="--conf spark.ui.showConsoleProgress=false pyspark-shell" timeout 600 "$vpy" wheel_stream.py "$venv") || fail "the stream"
echo "ok: pyspark $v untouched; install: pyspark ${t_spark} s, wheel ${t_wheel} s; stream $((SECONDS - t2)) s"
