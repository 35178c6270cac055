#!/usr/bin/env bash
# Busy-loop processes beside whatever you run: the "shared CI runner" load of issue #23.
#
#   scripts/load.sh start [N]      start N busy loops (default 2 per core), print their pids
#   scripts/load.sh stop           stop the loops the last `start` recorded (by pid)
#   scripts/load.sh status         list the recorded loops that are still running
#   scripts/load.sh [-n N] -- CMD  run CMD under N busy loops, stop them when CMD ends
#                                  (also on Ctrl-C / SIGTERM); exits with CMD's status
#
# Each loop is `sh -c 'while :; do :; done'` in its own process; only the pids this script
# started are ever signalled. `start`/`stop` keep the pids in $ZIO_LOAD_PIDFILE (default
# .cache/load.pids under the repo); `--` keeps them in memory only.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
pidfile=${ZIO_LOAD_PIDFILE:-$root/.cache/load.pids}
cores=$(nproc 2>/dev/null || getconf _NPROCESSORS_ONLN 2>/dev/null || echo 1)

usage() {
  sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
}

# start_loops N: start N loops, their pids into the array PIDS.
PIDS=()
start_loops() {
  local n=$1 i
  for ((i = 0; i < n; i++)); do
    sh -c 'while :; do :; done' &
    PIDS+=("$!")
  done
}

# stop_pids PID...: TERM each pid that is still a busy loop of ours, then wait for it.
stop_pids() {
  local pid
  for pid in "$@"; do
    # Only a pid whose command line is still our loop (a recycled pid is left alone).
    if [[ -r /proc/$pid/cmdline ]] && tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q 'while :; do :; done'; then
      kill -TERM "$pid" 2>/dev/null || true
    fi
  done
  for pid in "$@"; do
    wait "$pid" 2>/dev/null || true
  done
}

check_n() {
  [[ $1 =~ ^[1-9][0-9]*$ ]] || { echo "load.sh: N must be a positive integer, got '$1'" >&2; exit 2; }
}

n=$((2 * cores))
case "${1:-}" in
  start)
    [[ $# -ge 2 ]] && { check_n "$2"; n=$2; }
    if [[ -s $pidfile ]]; then
      echo "load.sh: $pidfile already lists loops ($(tr '\n' ' ' <"$pidfile")); run 'scripts/load.sh stop' first" >&2
      exit 1
    fi
    mkdir -p "$(dirname "$pidfile")"
    start_loops "$n"
    printf '%s\n' "${PIDS[@]}" >"$pidfile"
    echo "load.sh: started $n busy loops on $cores cores: ${PIDS[*]} (stop: scripts/load.sh stop)"
    ;;
  stop)
    if [[ ! -s $pidfile ]]; then
      echo "load.sh: no loops recorded in $pidfile"
      exit 0
    fi
    mapfile -t PIDS <"$pidfile"
    # Not our children any more (another shell started them): wait cannot reap them, so
    # poll until each has gone (bounded: a TERMed busy loop ends at once).
    stop_pids "${PIDS[@]}"
    for pid in "${PIDS[@]}"; do
      for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    done
    rm -f "$pidfile"
    echo "load.sh: stopped ${#PIDS[@]} busy loops: ${PIDS[*]}"
    ;;
  status)
    [[ -s $pidfile ]] || { echo "load.sh: no loops recorded"; exit 0; }
    while read -r pid; do
      if kill -0 "$pid" 2>/dev/null; then echo "$pid running"; else echo "$pid gone"; fi
    done <"$pidfile"
    ;;
  -n | --)
    if [[ $1 == -n ]]; then
      [[ $# -ge 3 && $3 == -- ]] || usage
      check_n "$2"; n=$2; shift 2
    fi
    shift
    [[ $# -ge 1 ]] || usage
    start_loops "$n"
    echo "load.sh: ${n} busy loops on $cores cores (${PIDS[*]}) beside: $*" >&2
    cleanup() { stop_pids "${PIDS[@]}"; PIDS=(); }
    trap cleanup EXIT
    # The command runs in its own process group (job control on while it starts: without
    # it a background command would ignore SIGINT); Ctrl-C and SIGTERM to this script are
    # passed to that group, then the loops are stopped once the command has ended.
    set -m
    "$@" &
    child=$!
    set +m
    trap 'kill -INT -- -"$child" 2>/dev/null' INT
    trap 'kill -TERM -- -"$child" 2>/dev/null' TERM
    while :; do
      wait "$child"
      rc=$?
      kill -0 "$child" 2>/dev/null || break  # wait returned for a signal, not the end
    done
    cleanup
    echo "load.sh: command exited $rc; busy loops stopped" >&2
    exit "$rc"
    ;;
  *) usage ;;
esac
