#!/usr/bin/env bash
# Fetch the wheels the lent H200's image and the GPU bundle (../shared/gpu/) lack (scripts/gpu-extra-wheels.txt),
# for Python 3.12 / manylinux x86_64, into git-ignored folders the device calls carry:
#   bash scripts/gpu_extra.sh [GROUP ...]     # default: base
# base -> .gpu-extra/*.whl and *.deb (the last carry call takes the folder whole); any other group -> .gpu-extra-GROUP/pNN,
# 40 MiB parts of one tar, each carried by one call (`mkdir -p /tmp/acc-GROUP && cp .gpu-extra-GROUP/pNN
# /tmp/acc-GROUP/`, the last part may stay in .gpu-extra-GROUP/). The `extra` phase of scripts/gpu_check.sh and
# scripts/gpu_run.sh installs them all into /tmp/site (scripts/gpu_extra_install.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
list=scripts/gpu-extra-wheels.txt
groups=("$@")
[ ${#groups[@]} -gt 0 ] || groups=(base)
for group in "${groups[@]}"; do
  mapfile -t wanted < <(sed 's/#.*//' "$list" | awk -v g="$group" '$1 == g {print $2}')
  if [ ${#wanted[@]} -eq 0 ]; then
    echo "gpu_extra: no group '$group' in $list; groups: $(sed 's/#.*//' "$list" | awk 'NF {print $1}' | sort -u | xargs)" >&2
    exit 2
  fi
  folder=.gpu-extra
  [ "$group" = base ] || folder=".gpu-extra-$group"
  grep -qx "/$folder/" .git/info/exclude 2>/dev/null || echo "/$folder/" >> .git/info/exclude
  work=$(mktemp -d)
  wheels=() debs=()
  for item in "${wanted[@]}"; do
    if [[ $item == deb:* ]]; then debs+=("${item#deb:}"); else wheels+=("$item"); fi
  done
  if [ ${#wheels[@]} -gt 0 ]; then
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      --platform manylinux_2_27_x86_64 -d "$work" "${wheels[@]}"
  fi
  if [ ${#debs[@]} -gt 0 ]; then  # Debian packages (amd64) from this machine's apt sources, unpacked there
    (cd "$work" && apt-get download -q "${debs[@]}" 2>&1 | grep -v "^W: Download is performed unsandboxed" || true)
    [ "$(find "$work" -name '*.deb' | wc -l)" -eq ${#debs[@]} ] || { echo "gpu_extra: apt-get download ${debs[*]} failed" >&2; exit 1; }
  fi
  rm -rf "$folder" && mkdir -p "$folder"
  if [ "$group" = base ]; then
    mv "$work"/*.whl "$work"/*.deb "$folder"/ 2>/dev/null || true
  else
    (cd "$work" && tar cf wheels.tar ./*.whl)  # groups in parts carry wheels only
    split -b 40M -d -a 2 "$work/wheels.tar" "$folder/p"  # beside the checkout (18 MiB) within a call's 64 MiB
  fi
  rm -rf "$work"
  ls -la "$folder"
done
