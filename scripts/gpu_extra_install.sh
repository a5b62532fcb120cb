# Sourced by the `extra` phase of scripts/gpu_check.sh and scripts/gpu_run.sh, from the repository root: install
# into /tmp/site (once per machine and group) the wheels scripts/gpu_extra.sh fetched: .gpu-extra/*.whl, and each
# group whose parts were carried to /tmp/acc-GROUP/ (any part may travel in .gpu-extra-GROUP/ instead); the Debian
# packages .gpu-extra/*.deb are unpacked into /tmp/site/debs and their programs linked into /tmp/site/bin (on PATH).
# The groups fp8 (torchao) and scan (Triton 3.7.1) go into /tmp/site-fp8 and /tmp/site-scan instead, on no path by
# default: vLLM imports torchao at start whenever it can, and compiles with the image's Triton 3.6.0 (torch 2.11's
# pin), so only the commands that need them put them first (PYTHONPATH=/tmp/site-GROUP:$PYTHONPATH): FP8 training;
# the trainer's Mamba-2 scan in fla's kernels, whose backward fla refuses on Hopper below Triton 3.7.1.
# GPU_EXTRA_SITE and GPU_EXTRA_ACC move /tmp/site and /tmp (the tests' own folders).
gpu_extra_install() {
  local status=0 folder group n target seen=" " site=${GPU_EXTRA_SITE:-/tmp/site} acc=${GPU_EXTRA_ACC:-/tmp}
  local -a parts
  if [ ! -f "$site/.gpu-extra-ok" ] && compgen -G ".gpu-extra/*.whl" > /dev/null; then
    if python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" .gpu-extra/*.whl
    then touch "$site/.gpu-extra-ok"; else status=1; fi
  fi
  if [ ! -f "$site/.gpu-extra-debs-ok" ] && compgen -G ".gpu-extra/*.deb" > /dev/null; then
    local deb program
    mkdir -p "$site/debs" "$site/bin"
    for deb in .gpu-extra/*.deb; do
      dpkg-deb -x "$deb" "$site/debs" || { echo "gpu_extra: cannot unpack $deb" >&2; status=1; }
    done
    for program in "$site"/debs/usr/bin/*; do
      [ -e "$program" ] && ln -sf "$program" "$site/bin/"
    done
    [ $status -eq 0 ] && touch "$site/.gpu-extra-debs-ok"
  fi
  for folder in "$acc"/acc-* .gpu-extra-*; do
    [ -d "$folder" ] || continue
    group=${folder##*/}; group=${group#acc-}; group=${group#.gpu-extra-}
    case "$seen" in *" $group "*) continue ;; esac
    seen="$seen$group "
    [ -f "$site/.gpu-extra-$group-ok" ] && continue
    parts=()
    for n in $(seq -f %02g 0 99); do  # p00, p01, ... from wherever each was carried, until one is missing
      if [ -f "$acc/acc-$group/p$n" ]; then parts+=("$acc/acc-$group/p$n")
      elif [ -f ".gpu-extra-$group/p$n" ]; then parts+=(".gpu-extra-$group/p$n")
      else break; fi
    done
    rm -rf "$acc/gpu-extra-$group" && mkdir -p "$acc/gpu-extra-$group"
    if [ ${#parts[@]} -gt 0 ] && cat "${parts[@]}" | tar x -C "$acc/gpu-extra-$group" 2> /dev/null; then
      target=$site
      case "$group" in fp8 | scan) target=$site-$group ;; esac
      if python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$target" \
        "$acc/gpu-extra-$group"/*.whl; then mkdir -p "$site" && touch "$site/.gpu-extra-$group-ok"; else status=1; fi
    else
      echo "gpu_extra: the parts of '$group' (${parts[*]:-none}) are not a whole archive: carry every part first" >&2
      status=1
    fi
  done
  return $status
}
