#!/usr/bin/env bash
# `make test-vllm`: kvloop in front of real vLLM engines (docs/vllm.md).
#   1. vLLM's CPU build + NIXL in a cached venv (scripts/vllm/install.sh; skipped when present)
#   2. the kvloop-vllm plugin (python/kvloop-vllm) into that venv, and its unit tests
#   3. tests/vllm (pytest): 1 P + 1 D vLLM engines in two network namespaces,
#      agents, kvloop-router; bounded by KVLOOP_VLLM_TIMEOUT_S (default 1500 s)
# Binaries come from target/debug (the Makefile builds them first) or $KVLOOP_BIN_DIR.
# Extra arguments go to pytest (e.g. -k plugin).
set -euo pipefail
cd "$(dirname "$0")/../.."
start=$(date +%s)
scripts/vllm/install.sh
V="${KVLOOP_VLLM_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/kvloop/vllm-venv}"
"$V/bin/python" -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation \
  --force-reinstall python/kvloop-vllm
"$V/bin/python" -m pytest -q -p no:cacheprovider python/kvloop-vllm/tests
# kvloop's NIXL environment (exported by the Makefile) stays for kvloop's
# processes; scripts/vllm/cluster.py clears it for the engines, which load
# vLLM's own NIXL build.
rc=0
timeout --signal=TERM --kill-after=60 "${KVLOOP_VLLM_TIMEOUT_S:-1500}" \
  "$V/bin/python" -m pytest -v -s -p no:cacheprovider tests/vllm "$@" || rc=$?
echo "test-vllm: finished in $(( $(date +%s) - start )) s (rc=$rc)"
exit $rc
