#!/usr/bin/env bash
# Runs kvloop's deployment tests (deploy/tests, pytest). Creates or refreshes
# the virtual environment target/deploy-venv from requirements.txt first.
#
#   deploy/tests/run.sh                 # all tests
#   deploy/tests/run.sh -k manifests    # pytest arguments pass through
#
# Binaries come from target/debug (or $KVLOOP_BIN_DIR): kvloop-router,
# kvloop-engine-sim, kvloop-agent. Also needed: Debian's `prometheus`,
# util-linux's setpriv/prlimit, and root for the eBPF and capability tests.
# With CI=true a missing dependency fails the test instead of skipping it.
set -euo pipefail
cd "$(dirname "$0")/../.."
V=target/deploy-venv
if [ ! -x "$V/bin/pytest" ] || ! cmp -s deploy/tests/requirements.txt "$V/.requirements"; then
  python3 -m venv "$V"
  "$V/bin/pip" install -q --disable-pip-version-check -r deploy/tests/requirements.txt
  cp deploy/tests/requirements.txt "$V/.requirements"
fi
exec "$V/bin/pytest" -c deploy/tests/pytest.ini deploy/tests "$@"
