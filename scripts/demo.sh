#!/usr/bin/env bash
# Set up .venv (first run: about a minute) and run the end-to-end demo:
# local Spark, an embedded producer, readStream.format("zio") -> windows ->
# writeStream.format("zio") -> an embedded consumer, with a live view, an exactly-once
# check and a throughput plot in demo-output/. Extra arguments go to `zio-spark demo`.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash scripts/setup.sh
exec .venv/bin/zio-spark demo "$@"
