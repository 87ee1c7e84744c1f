#!/usr/bin/env bash
# Runs kvloop's fuzz targets (fuzz/fuzz_targets, cargo-fuzz on the nightly
# toolchain) one after the other, each for a bounded time, prints a table
# target | executions | seconds | crashes and fails when any target crashed.
# Installs cargo-fuzz (and the nightly toolchain) first when missing.
#
#   scripts/fuzz.sh                    # every target, FUZZ_SECONDS each
#   scripts/fuzz.sh sse kv_params      # only some targets
#   FUZZ_SECONDS=600 scripts/fuzz.sh   # longer runs (default 60 s per target)
#
# The committed seeds are fuzz/seeds/<target>/; what a run adds goes to
# fuzz/corpus/<target>/ (kept between runs, not committed), crashing inputs
# to fuzz/artifacts/<target>/, each target's libFuzzer output to
# fuzz/logs/<target>.log. A crash is replayed with
# `cargo +nightly fuzz run <target> fuzz/artifacts/<target>/<file>`; every
# crash becomes a regression test in the crate at fault.
set -euo pipefail
cd "$(dirname "$0")/.."

FUZZ_SECONDS="${FUZZ_SECONDS:-60}"
FUZZ_MAX_LEN="${FUZZ_MAX_LEN:-65536}"
ALL_TARGETS=(kv_params sse agent_frame side_channel)
targets=("$@")
[ ${#targets[@]} -eq 0 ] && targets=("${ALL_TARGETS[@]}")

log() { printf '[fuzz] %s\n' "$*" >&2; }

if ! rustup toolchain list | grep -q '^nightly'; then
  log "installing the nightly toolchain"
  rustup toolchain install nightly --profile minimal
fi
if cargo +nightly fuzz --version >/dev/null 2>&1; then
  log "cargo-fuzz present: $(cargo +nightly fuzz --version)"
else
  log "installing cargo-fuzz"
  cargo install cargo-fuzz --locked
fi

log "building the fuzz targets"
cargo +nightly fuzz build >&2
mkdir -p fuzz/logs
rows=()
failed=0
for t in "${targets[@]}"; do
  mkdir -p "fuzz/corpus/$t" "fuzz/artifacts/$t"
  before=$(find "fuzz/artifacts/$t" -type f | wc -l)
  log "$t: ${FUZZ_SECONDS}s"
  start=$(date +%s)
  rc=0
  cargo +nightly fuzz run "$t" "fuzz/corpus/$t" "fuzz/seeds/$t" -- \
    -max_total_time="$FUZZ_SECONDS" -max_len="$FUZZ_MAX_LEN" -rss_limit_mb=2048 \
    -print_final_stats=1 >"fuzz/logs/$t.log" 2>&1 || rc=$?
  secs=$(( $(date +%s) - start ))
  execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "fuzz/logs/$t.log" | grep -o '[0-9]*$' | tail -n 1 || true)
  [ -z "$execs" ] && execs=$(grep -o '^#[0-9]*' "fuzz/logs/$t.log" | tr -d '#' | tail -n 1 || true)
  crashes=$(( $(find "fuzz/artifacts/$t" -type f | wc -l) - before ))
  if [ "$rc" -ne 0 ] && [ "$crashes" -eq 0 ]; then crashes=1; fi
  if [ "$crashes" -ne 0 ]; then
    failed=1
    log "$t crashed (exit $rc): see fuzz/logs/$t.log and fuzz/artifacts/$t/"
  fi
  rows+=("$(printf '%-13s | %12s | %7s | %7s' "$t" "${execs:-?}" "$secs" "$crashes")")
done

printf '%-13s | %12s | %7s | %7s\n' target executions seconds crashes
printf -- '--------------+--------------+---------+--------\n'
printf '%s\n' "${rows[@]}"
exit "$failed"
