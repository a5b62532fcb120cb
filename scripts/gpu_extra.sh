#!/usr/bin/env bash
# The wheels the lent H200's image and the GPU bundle (../shared/gpu/) both lack that agentrl's GPU runs import
# (datasets for the environments' rows, and multiprocess, which datasets needs), into the git-ignored
# .gpu-extra/ that the last carry call takes along (scripts/gpu_check.sh, scripts/gpu_run.sh: phase extra).
#   bash scripts/gpu_extra.sh
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.gpu-extra/' .git/info/exclude 2>/dev/null || echo '/.gpu-extra/' >> .git/info/exclude
rm -rf .gpu-extra && mkdir -p .gpu-extra
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .gpu-extra datasets==4.7.0 multiprocess==0.70.18
ls -la .gpu-extra
