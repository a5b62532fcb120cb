# Sourced by scripts/gpu_check.sh and scripts/gpu_run.sh on the device machine: which one-GPU recipe fits the card.
#   h200  a card of 100 GiB or more: glm-air-5b (cookbook/gpu-1xh200/sft.toml, train.toml, agent-*.toml), which needs
#         about 124 GiB beside vLLM
#   80g   a smaller card (an H100): glm-air-32e, glm-air-5b with 32 of its 128 routed experts (the *-80g.toml files)
# GPU_CHECK_PROFILE=h200|80g overrides. Sets `profile`, `suffix` (the recipes' file-name suffix) and `warm` (the
# reverse-text warm start the sft phase writes); prints the choice, and appends it to $profile_log when set.
gpu_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1 | tr -dc 0-9)
profile=${GPU_CHECK_PROFILE:-$([ "${gpu_mib:-0}" -ge 102400 ] && echo h200 || echo 80g)}
case "$profile" in
  h200) suffix="" warm=runs/gpu-1xh200/glm-air-5b-sft ;;
  80g) suffix="-80g" warm=runs/gpu-1xh200/glm-air-32e-sft ;;
  *) echo "gpu_profile: GPU_CHECK_PROFILE must be h200 or 80g, not '$profile'" >&2; return 2 ;;
esac
line="profile: $profile (cookbook/gpu-1xh200/train$suffix.toml)"
if [ -n "${profile_log:-}" ]; then echo "$line" | tee -a "$profile_log"; else echo "$line"; fi
