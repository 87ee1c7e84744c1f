#!/usr/bin/env bash
# Every test of the workspace, as `make test` runs them (as root, binaries
# built first, the NIXL environment exported by the Makefile):
#
# 1. `cargo test --workspace -- --include-ignored`: the tests that need root,
#    the NIXL runtime, util-linux's setpriv or an IPv6 loopback are
#    `#[ignore = "needs ..."]` (a plain `cargo test` lists them as ignored);
#    here they run, and each fails naming what is missing.
# 2. The GPU tests (`gpu_*` in dataplane/tests/cuda.rs, feature `cuda`): run
#    where `nvidia-smi -L` lists a GPU, otherwise listed and counted as ignored.
# 3. The deployment tests (deploy/tests/run.sh, pytest).
#
# Prints the counts (passed, failed, ignored) at the end. With CI=true a run
# that leaves any non-GPU test ignored, or any pytest test skipped, fails.
# Logs: target/test-logs/.
set -uo pipefail
cd "$(dirname "$0")/.."
LOG=target/test-logs
mkdir -p "$LOG"
status=0

cargo test --workspace --no-fail-fast -- --include-ignored --test-threads=2 2>&1 \
  | tee "$LOG/workspace.log" || status=1

if nvidia-smi -L 2>/dev/null | grep -q GPU; then
  gpu="a GPU is present: run"
  gpu_args=(--include-ignored)
else
  gpu="no GPU (nvidia-smi lists none): counted as ignored"
  gpu_args=()
fi
cargo test -p kvloop-dataplane --features cuda --test cuda -- "${gpu_args[@]}" 2>&1 \
  | tee "$LOG/gpu.log" || status=1

deploy/tests/run.sh 2>&1 | tee "$LOG/deploy.log" || status=1

# Sums of the `test result:` lines of a cargo test log: "passed failed ignored".
counts() {
  awk '/^test result:/ {
         for (i = 2; i <= NF; i++) {
           if ($i ~ /^passed;?$/) p += $(i - 1)
           if ($i ~ /^failed;?$/) f += $(i - 1)
           if ($i ~ /^ignored;?$/) g += $(i - 1)
         }
       }
       END { printf "%d %d %d\n", p, f, g }' "$1"
}
read -r wp wf wi < <(counts "$LOG/workspace.log")
read -r gp gf gi < <(counts "$LOG/gpu.log")
# pytest's last line, e.g. "==== 40 passed, 2 skipped in 3.10s ===="
py=$(grep -E '^=+ .*(passed|failed|skipped|error).* in [0-9.]+s' "$LOG/deploy.log" | tail -1 | tr -d '=')
py_skipped=$(grep -oE '[0-9]+ skipped' <<<"$py" | grep -oE '[0-9]+' || echo 0)

echo
echo "make test: workspace: $wp passed, $wf failed, $wi ignored"
echo "make test: GPU tests: $gp passed, $gf failed, $gi ignored ($gpu)"
grep -hE '^test .* \.\.\. ignored' "$LOG/workspace.log" "$LOG/gpu.log" | sed 's/^/  ignored: /'
echo "make test: deployment tests:${py:- no summary line (see $LOG/deploy.log)}"

if [ "${CI:-}" = "true" ] && { [ "$wi" -ne 0 ] || [ "${py_skipped:-0}" -ne 0 ]; }; then
  echo "make test: CI=true and tests were left ignored or skipped: failing" >&2
  status=1
fi
exit "$status"
