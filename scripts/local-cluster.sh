#!/usr/bin/env bash
# A Spark standalone cluster on this machine, loopback only: a master and N workers, each a
# separate process (group) with its own work dir, local dir and TMPDIR, from the Spark that
# ships inside pyspark. Runs in the foreground until Ctrl-C / SIGTERM, then stops them all.
#
#   scripts/local-cluster.sh [--workers N] [--cores C] [--memory 1g] [--dir DIR] [--hide PATH]
#
#   --workers N    workers to start (default 2), each with --cores (1) and --memory (1g)
#   --dir DIR      where logs and the workers' folders go (default: a new temp folder)
#   --hide PATH    (root, util-linux unshare) run the workers in a private mount namespace
#                  where PATH is an empty tmpfs: their executors cannot read what the driver
#                  keeps under PATH (put the zio source's spoolPath there to see executors
#                  fetch through the segment server, as on a real cluster)
#
# Prints, once every worker has registered:
#   MASTER=spark://127.0.0.1:<port>   MASTER_PID=<pid>   WORKER<i>_PID=<pid>   READY
# (each PID is also its process group: `kill -9 -- -<pid>` takes a worker down with its
# executors). Then submit to it, e.g.
#   PYSPARK_PYTHON=$PWD/.venv/bin/python .venv/bin/python my_job.py   # master(MASTER)
# Environment: PYTHON (default .venv/bin/python, else python3) finds pyspark and is the
# workers' PYSPARK_PYTHON.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)

workers=2 cores=1 memory=1g dir="" hide=""
while [ $# -gt 0 ]; do
  case "$1" in
    --workers) workers=$2; shift 2 ;;
    --cores) cores=$2; shift 2 ;;
    --memory) memory=$2; shift 2 ;;
    --dir) dir=$2; shift 2 ;;
    --hide) hide=$2; shift 2 ;;
    -h|--help) sed -n '2,24p' "$0"; exit 0 ;;
    *) echo "local-cluster: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
case "$workers" in ''|*[!0-9]*|0) echo "local-cluster: --workers '$workers': need an integer >= 1" >&2; exit 2 ;; esac

py=${PYTHON:-}
if [ -z "$py" ]; then
  if [ -x "$root/.venv/bin/python" ]; then py=$root/.venv/bin/python; else py=python3; fi
fi
spark_home=$("$py" -c 'import os, pyspark; print(os.path.dirname(pyspark.__file__))') \
  || { echo "local-cluster: cannot import pyspark with $py (set PYTHON=...)" >&2; exit 2; }
command -v java >/dev/null || { echo "local-cluster: java not found (Spark needs Java 17)" >&2; exit 2; }
if [ -n "$hide" ]; then
  [ "$(id -u)" = 0 ] || { echo "local-cluster: --hide needs root (mount namespaces)" >&2; exit 2; }
  command -v unshare >/dev/null || { echo "local-cluster: --hide needs unshare (util-linux)" >&2; exit 2; }
  mkdir -p "$hide"
fi
[ -n "$dir" ] || dir=$(mktemp -d "${TMPDIR:-/tmp}/zio-local-cluster.XXXXXX")
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)

export SPARK_HOME=$spark_home SPARK_LOCAL_IP=127.0.0.1 SPARK_LOG_DIR=$dir/logs \
  SPARK_PID_DIR=$dir PYSPARK_PYTHON=$py PYSPARK_DRIVER_PYTHON=$py
export SPARK_MASTER_OPTS="-Dspark.master.rest.enabled=false ${SPARK_MASTER_OPTS:-}"
port=$("$py" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
master_url=spark://127.0.0.1:$port

set -m  # every background job gets its own process group (pgid = its pid)
pids=()
stop_all() {
  trap - EXIT INT TERM
  local p i
  for ((i = ${#pids[@]} - 1; i >= 0; i--)); do kill -TERM -- "-${pids[i]}" 2>/dev/null || true; done
  for _ in $(seq 1 50); do
    local alive=0
    for p in "${pids[@]}"; do kill -0 -- "-$p" 2>/dev/null && alive=1; done
    [ $alive = 0 ] && break
    sleep 0.2
  done
  for p in "${pids[@]}"; do kill -KILL -- "-$p" 2>/dev/null || true; done
}
trap stop_all EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

"$spark_home/bin/spark-class" org.apache.spark.deploy.master.Master \
  --host 127.0.0.1 --port "$port" --webui-port 0 >"$dir/master.log" 2>&1 &
master_pid=$!
pids+=("$master_pid")

wait_for() {  # wait_for <seconds> <what> <command...>: poll the command until it succeeds
  local limit=$1 what=$2; shift 2
  local end=$((SECONDS + limit))
  until "$@" 2>/dev/null; do
    if [ $SECONDS -ge $end ]; then
      echo "local-cluster: $what not ready after ${limit}s; logs in $dir" >&2; exit 1
    fi
    kill -0 "$master_pid" 2>/dev/null || { echo "local-cluster: the master died; see $dir/master.log" >&2; tail -20 "$dir/master.log" >&2; exit 1; }
    sleep 0.2
  done
}
wait_for 120 "master on $master_url" bash -c "exec 3<>/dev/tcp/127.0.0.1/$port"
echo "MASTER=$master_url"
echo "MASTER_PID=$master_pid"

for i in $(seq 1 "$workers"); do
  w=$dir/worker-$i
  mkdir -p "$w/work" "$w/local" "$w/tmp"
  cmd=("$spark_home/bin/spark-class" org.apache.spark.deploy.worker.Worker
       --host 127.0.0.1 --webui-port 0 --cores "$cores" --memory "$memory"
       --work-dir "$w/work" "$master_url")
  if [ -n "$hide" ]; then
    cmd=(unshare --mount --propagation private sh -c \
         'mount -t tmpfs -o size=1m,mode=0755 zio-hidden "$0" && exec "$@"' "$hide" "${cmd[@]}")
  fi
  SPARK_WORKER_DIR=$w/work SPARK_LOCAL_DIRS=$w/local TMPDIR=$w/tmp \
    "${cmd[@]}" >"$w/worker.log" 2>&1 &
  pids+=("$!")
  echo "WORKER${i}_PID=$!"
  echo "WORKER${i}_DIR=$w"
done
for i in $(seq 1 "$workers"); do
  wait_for 180 "worker $i" grep -q "Successfully registered with master" "$dir/worker-$i/worker.log"
done
echo "READY"

# Until Ctrl-C / SIGTERM (or the master exits); a worker that dies stays dead.
while kill -0 "$master_pid" 2>/dev/null; do
  wait "$master_pid" || true
done
echo "local-cluster: the master exited; see $dir/master.log" >&2
exit 1
