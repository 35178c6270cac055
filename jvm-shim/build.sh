#!/usr/bin/env bash
# Build jvm-shim/build/zio-spark-example.jar with javac and jar only: the compile classpath
# is the jars that ship inside pyspark (no Maven, no network). Idempotent: recompiles only
# when a source is newer than the jar; --clean forces a rebuild.
#
# Environment: ZIO_PYTHON (interpreter whose pyspark gives the jars; default
# <repo>/.venv/bin/python, else python3) or ZIO_SPARK_HOME (a Spark distribution), JAVA_HOME.
set -euo pipefail

shim="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(dirname "$shim")"
build="$shim/build"
classes="$build/classes"
jarfile="$build/zio-spark-example.jar"

die() { printf 'build.sh: %s\n' "$*" >&2; exit 2; }

if [ "${1:-}" = "--clean" ]; then rm -rf "$build"; fi

if [ -n "${JAVA_HOME:-}" ]; then javac="$JAVA_HOME/bin/javac"; jar="$JAVA_HOME/bin/jar"; else
    javac="$(command -v javac || true)"; jar="$(command -v jar || true)"; fi
[ -x "$javac" ] && [ -x "$jar" ] || die "javac and jar (a JDK, 17+) are needed: apt-get install openjdk-17-jdk-headless"

spark_home="${ZIO_SPARK_HOME:-}"
if [ -z "$spark_home" ]; then
    py="${ZIO_PYTHON:-}"
    if [ -z "$py" ]; then
        if [ -x "$repo/.venv/bin/python" ]; then py="$repo/.venv/bin/python"; else py=python3; fi
    fi
    spark_home="$("$py" -c 'import os, pyspark; print(os.path.dirname(pyspark.__file__))')" \
        || die "cannot import pyspark with $py (set ZIO_PYTHON or ZIO_SPARK_HOME)"
fi
[ -d "$spark_home/jars" ] || die "no jars/ folder in $spark_home"

sources=()
while IFS= read -r f; do sources+=("$f"); done < <(find "$shim/src/main/java" -name '*.java' | sort)
[ "${#sources[@]}" -gt 0 ] || die "no Java sources under $shim/src/main/java"

stale=0
if [ ! -f "$jarfile" ]; then stale=1; else
    for s in "${sources[@]}" "${BASH_SOURCE[0]}"; do [ "$s" -nt "$jarfile" ] && stale=1; done
fi
if [ "$stale" = 0 ]; then echo "$jarfile (up to date)"; exit 0; fi

mkdir -p "$build"
work="$(mktemp -d "$build/.work.XXXXXX")"
trap 'rm -rf "$work"' EXIT
# -path: jars inside pyspark name absent jars in their manifests (derby, scala-reflect).
# --release 17: the class files run on Java 17, Spark 4's minimum, whatever JDK builds them.
"$javac" --release 17 -Xlint:all,-options,-path -Werror -encoding UTF-8 \
    -cp "$spark_home/jars/*" -d "$work/classes" "${sources[@]}"
"$jar" --create --file "$work/out.jar" -C "$work/classes" .
# Publish atomically, so a concurrent run never sees a half-written jar.
mv -f "$work/out.jar" "$jarfile"
rm -rf "$classes"
mv "$work/classes" "$classes"
echo "$jarfile"
