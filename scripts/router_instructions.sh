#!/usr/bin/env bash
# The router's user-space instructions per request, counted by valgrind's
# callgrind: repeatable where chat_bench's wall-clock CPU per request moves
# by ±30 % between rounds on a shared VM. Each given kvloop-router binary
# (default: this checkout's, built by `cargo bench`) serves chat_bench's
# first router row (in-memory store, prefix check by tokens) at
# RATE req/s under callgrind; after WARM_S seconds the counters are zeroed,
# after MEASURE_S more they are dumped, and instructions ÷ (RATE × MEASURE_S)
# is printed. Kernel time (loopback sends) is not counted: see
# docs/operator-guide.md, "Router CPU".
#
#   scripts/router_instructions.sh                         # this checkout
#   scripts/router_instructions.sh /tmp/old-router target/release/kvloop-router
#   RATE=30 WARM_S=7 MEASURE_S=6 scripts/router_instructions.sh
#
# Run it on an otherwise idle machine (a second bench skews the window).
# KEEP=1 keeps the bench log and callgrind dumps (printed path).
# Needs valgrind (Debian package). Loopback only; every process it starts
# is in its own process group and stopped by that group's id.
set -euo pipefail
cd "$(dirname "$0")/.."

RATE="${RATE:-30}"
WARM_S="${WARM_S:-7}"
MEASURE_S="${MEASURE_S:-6}"
command -v callgrind_control >/dev/null || {
  echo "valgrind is missing: apt-get install -y valgrind" >&2
  exit 2
}
cargo bench -p kvloop-router --bench chat_bench --no-run >&2
bins=("$@")
[ ${#bins[@]} -eq 0 ] && bins=("$PWD/target/release/kvloop-router")

work="$(mktemp -d /tmp/kvloop-router-instr.XXXXXX)"
trap 'if [ -n "${KEEP:-}" ]; then echo "kept: $work" >&2; else rm -rf "$work"; fi' EXIT
printf '| router binary | instructions per request | requests counted |\n|---|---:|---:|\n'
for bin in "${bins[@]}"; do
  bin="$(realpath "$bin")"
  wrapper="$work/router.sh"
  printf '#!/bin/sh\nexec valgrind --tool=callgrind --callgrind-out-file=%s/cg.%%p.out %s "$@"\n' \
    "$work" "$bin" >"$wrapper"
  chmod +x "$wrapper"
  rm -f "$work"/cg.*
  KVLOOP_BENCH_RATE="$RATE" KVLOOP_BENCH_BASELINE_ROUTER="$wrapper" \
    setsid cargo bench -p kvloop-router --bench chat_bench >"$work/bench.log" 2>&1 &
  group=$!
  pid=""
  for _ in $(seq 1 600); do
    # The wrapper execs valgrind: its process is the router's.
    pid="$(pgrep -g "$group" -f "callgrind-out-file=$work" | head -1 || true)"
    [ -n "$pid" ] && break
    sleep 0.1
  done
  if [ -z "$pid" ]; then
    kill -TERM -- "-$group" 2>/dev/null || true
    echo "the router under callgrind did not start; see the bench log:" >&2
    tail -20 "$work/bench.log" >&2
    exit 1
  fi
  sleep "$WARM_S"
  callgrind_control -z "$pid" >/dev/null
  sleep "$MEASURE_S"
  callgrind_control -d "$pid" >/dev/null
  sleep 1
  kill -TERM -- "-$group" 2>/dev/null || true
  wait "$group" 2>/dev/null || true
  ir="$(grep -h '^summary:' "$work"/cg."$pid".out.1 | awk '{print $2}')"
  n=$((RATE * MEASURE_S))
  printf '| %s | %s | %s |\n' "$bin" "$((ir / n))" "$n"
done
