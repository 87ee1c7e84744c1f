#!/usr/bin/env bash
# Installs what kvloop's build, tests and demo need on a fresh Debian 12 machine
# of this kind, and skips every step whose result is already there.
#
#   scripts/bootstrap.sh            # everything
#   scripts/bootstrap.sh apt nixl   # only some steps: apt, nixl, ebpf
#
# Steps:
#   apt   Debian packages: libfabric (1.17 here; 2.x comes from the EFA installer
#         on EFA nodes), libclang for bindgen, iproute2 for network namespaces,
#         LLVM 22 for bpf-linker, libcap2-bin for capsh; redis-server (the
#         router's shared-store tests start their own), faketime (the clock-offset
#         READ test), tmux (the `kvloop top` terminal test), curl (the held-demo test).
#   nixl  NIXL runtime libraries from the PyPI wheel nixl-cu12==1.5.1 into
#         $KVLOOP_NIXL_DIR (default ~/.cache/kvloop/nixl-cu12-1.5.1). The wheel
#         carries libnixl_capi.so and the UCX/LIBFABRIC plugins, no headers, so
#         nixl-sys is built with its `stub-api` feature and dlopens them.
#   ebpf  nightly rust-src (aya-build compiles core for bpfel) and bpf-linker
#         0.13.0 built against LLVM 22 (docs/recipes.md).
#   venv  Python packages of the deployment tests (deploy/tests/requirements.txt:
#         pytest, kubernetes-validate, helm-python-sdk, ...) in target/deploy-venv.
#
# The `prometheus` package is for the dashboard test (a real Prometheus on
# 127.0.0.1); its service is not used.
set -euo pipefail

steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(apt nixl ebpf venv)

log() { printf '[bootstrap] %s\n' "$*" >&2; }
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo"

APT_PKGS=(libfabric-dev libfabric-bin libclang-dev pkg-config iproute2 llvm-22-dev libcap2-bin unzip python3-pip prometheus redis-server faketime tmux curl)
NIXL_VERSION=1.5.1
NIXL_DIR="${KVLOOP_NIXL_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kvloop/nixl-cu12-$NIXL_VERSION}"
BPF_LINKER_VERSION=0.13.0

step_apt() {
  local missing=()
  for p in "${APT_PKGS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
  done
  if [ ${#missing[@]} -eq 0 ]; then log "apt: all packages present"; return; fi
  log "apt: installing ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
}

step_nixl() {
  local libdir="$NIXL_DIR/.nixl_cu12.mesonpy.libs"
  if [ -f "$libdir/libnixl_capi.so" ] && [ -f "$libdir/plugins/libplugin_UCX.so" ]; then
    log "nixl: runtime present in $NIXL_DIR"; return
  fi
  log "nixl: fetching nixl-cu12==$NIXL_VERSION wheel (about 68 MB)"
  local tmp; tmp=$(mktemp -d)
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 \
    --platform manylinux_2_28_x86_64 "nixl-cu12==$NIXL_VERSION" -d "$tmp"
  mkdir -p "$NIXL_DIR"
  python3 - "$tmp" "$NIXL_DIR" <<'PY'
import os, sys, zipfile
src, dst = sys.argv[1], sys.argv[2]
whl = [f for f in os.listdir(src) if f.endswith(".whl")][0]
with zipfile.ZipFile(os.path.join(src, whl)) as z:
    for n in z.namelist():
        if n.startswith((".nixl_cu12.mesonpy.libs/", "nixl_cu12.libs/")):
            z.extract(n, dst)
PY
  rm -rf "$tmp"
  log "nixl: runtime in $NIXL_DIR"
}

step_ebpf() {
  if ! rustup component list --toolchain nightly --installed 2>/dev/null | grep -q '^rust-src'; then
    log "ebpf: adding rust-src to the nightly toolchain"
    rustup component add rust-src --toolchain nightly
  fi
  if command -v bpf-linker >/dev/null 2>&1 && bpf-linker --version 2>/dev/null | grep -q "$BPF_LINKER_VERSION"; then
    log "ebpf: bpf-linker $BPF_LINKER_VERSION present"; return
  fi
  log "ebpf: building bpf-linker $BPF_LINKER_VERSION against LLVM 22 (about 3 min)"
  LLVM_PREFIX=/usr/lib/llvm-22 cargo install --locked -q "bpf-linker@$BPF_LINKER_VERSION" \
    --no-default-features --features llvm-22
}

step_venv() {
  local top; top="$(cd "$(dirname "$0")/.." && pwd)"
  local v="$top/target/deploy-venv" req="$top/deploy/tests/requirements.txt"
  if [ -x "$v/bin/pytest" ] && cmp -s "$req" "$v/.requirements"; then
    log "venv: deploy test packages present"; return
  fi
  log "venv: installing deploy test packages into $v"
  mkdir -p "$top/target"
  python3 -m venv "$v"
  "$v/bin/pip" install -q --disable-pip-version-check -r "$req"
  cp "$req" "$v/.requirements"
}

for s in "${steps[@]}"; do
  case "$s" in
    apt) step_apt ;;
    nixl) step_nixl ;;
    ebpf) step_ebpf ;;
    venv) step_venv ;;
    *) echo "bootstrap: unknown step '$s' (expected apt, nixl, ebpf or venv)" >&2; exit 2 ;;
  esac
done
