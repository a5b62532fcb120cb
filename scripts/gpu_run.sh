#!/usr/bin/env bash
# The one-GPU session on a lent H200 (docs/gpu.md), after the bundle is carried
# (../shared/gpu/make-gpu-bundle.sh: 7 parts; the last call also carries .gpu-extra/ and assemble.sh):
#   source .gpu-bundle/assemble.sh && OUT=$OUT bash scripts/gpu_run.sh [PHASE ...]
# Phases, in the order given (default: extra fixtures tests sft train), each under its own timeout and
# each writing into $OUT; a failed phase is reported and the next one still runs:
#   extra     the wheels the image and the bundle lack (scripts/gpu_extra.sh) into /tmp/site (gpu_extra_install.sh)
#   fixtures  CUDA vLLM's answers to agentrl's requests -> $OUT/fixtures/vllm-<version>/ (scripts/record_vllm_fixtures.py)
#   tests     tests/gpu/test_loop_gpu.py (routed experts vs the trainer's router, IPC update logprobs)
#   sft       agentrl sft --config cookbook/gpu-1xh200/sft.toml (creates glm-air-5b on the GPU first)
#   train     agentrl train --config cookbook/gpu-1xh200/train.toml -> $OUT/run (report, plots, metrics; no weights)
#   bench     python3 bench/gpu_loop.py --measure (IPC and filesystem update latency, agentrl eval vs raw
#             tokens/s eager and with CUDA graphs; glm-air-5b as created when no SFT ran) -> $OUT/gpu_loop.json
#   gputests  the trainer's model tests on CUDA: MLA, Nemotron-3 (grouped non-gated experts, the fla scan)
#   steptime  bench/step_time_check.py: the planner's trainer step time against measured steps -> $OUT
#   nemotron  bench/trainer_mfu_nemotron.py: Nemotron-3-Nano-shaped MFU, Mamba scan share (torch, fla) -> $OUT
#   r3deep    agentrl sft + train of glm-air-deep (cookbook/gpu-1xh200/r3-deep-*.toml) -> $OUT/r3-deep-run;
#             its halves r3deep-sft and r3deep-train run alone too (the SFT export stays on a warm machine)
#   nemo      agentrl sft + train of nemotron-nano-7l (cookbook/gpu-1xh200/nemotron-*.toml: CUDA vLLM serving NemotronH,
#             R3, IPC updates, the fla scan) -> $OUT/nemotron-run; halves nemo-sft and nemo-train run alone too
#   evalbench bench/gpu_loop.py --measure --eval-only --created-model: the eval throughput alone, on glm-air-5b
#             as created (answers run to max_tokens) -> $OUT/gpu_loop.json
#   deepipc   bench/gpu_loop.py --measure --updates-only --created-model glm-air-deep: IPC updates packed and
#             unpacked (over 17,000 tensors) and one through the filesystem -> $OUT/gpu_loop.json
#   lora      agentrl train of the one-GPU recipe with LoRA (rank 16 on attention, routed and shared experts; the
#             adapter served after every step) -> $OUT/lora-run; `python3 bench/lora.py --summarize` against the
#             check's run-1 (full fine-tuning, same session) -> bench/results/lora.json
#   loop-fp8, loop-kv, loop-mooncake, loop-pd   issue 35: the train recipe for LOOP_STEPS (20) steps with FP8 serving,
#             native KV offload, Mooncake KV offload, or a P/D pair over NIXL (scripts/gpu-loops.txt's overrides; the
#             warm start first when missing) -> $OUT/<phase> (LOOP_ARGS: extra --set)
#   features  the gpu_feature tests (tests/gpu -m gpu_feature): routed experts through native KV offload equal the
#             routing computed whole (inference/vllm_plugin/routed_offload.py); a kernel-format ipc update gives
#             the trainer's logprobs (inference/kernel_format.py); P/D through the folder connector with the
#             routing stitched by the token client equals one server's (tests/gpu/test_pd_gpu.py)
#   agent-sft agentrl sft of glm-air-5b on the harder key-hunt's oracle episodes (cookbook/gpu-1xh200/agent-sft.toml;
#             the reverse-text warm start first when missing), sandboxes under bwrap over a rootfs of this machine's
#             programs (environments/key_hunt/key_hunt_rootfs.py) -> $OUT/agent-sft.json
#   agent-train agentrl train --config cookbook/gpu-1xh200/agent-train.toml -> $OUT/agent-run (AGENT_ARGS: extra --set)
#   agent-eval  agentrl eval of its last checkpoint against the warm start (agent-eval.toml) -> $OUT/agent-eval
# On a card under 100 GiB (an H100) sft, train, lora and agent-* run the 80g profile's recipes (*-80g.toml:
# glm-air-32e, glm-air-5b with 32 routed experts), since glm-air-5b's need about 124 GiB (scripts/gpu_profile.sh).
# On nvidia-h200-x2 (issue 25: trainer on GPU 0, vLLM on GPU 1, weights through NCCL; sft first for the warm start):
#   x2tests   tests/gpu/test_weights_nccl.py (NCCL update logprobs, a request in flight, restart + re-send)
#   x2train   agentrl train --config cookbook/gpu-2xh200/train.toml -> $OUT/x2-run
#   x2sync    the same recipe synchronous (max_off_policy_steps 0, 16 steps) -> $OUT/x2-sync-run
#   x2bench   python3 bench/gpu_loop.py --measure-nccl (NCCL update latency and GB/s against the one-GPU
#             IPC/filesystem figures; the x2train/x2sync runs summarised when present) -> $OUT/gpu_loop_x2.json
# Environment: TRAIN_ARGS (extra `--set` arguments for the train phase), R3DEEP_ARGS (the same for
# r3deep-train, e.g. `--set orchestrator.max_off_policy_steps=0` for on-policy R3 figures), TESTS_ARGS (extra pytest arguments
# for the tests phase, e.g. `-k restarted`), <PHASE>_TIMEOUT (seconds).
# The device tool brings back at most 8 files from $OUT: everything is written into a work folder
# and packed into $OUT/gpu_run-<first phase>.tgz when the script ends (also when it is stopped);
# phases.txt and gpu.txt are copied beside it.
set -uo pipefail
dest="${OUT:-/tmp/gpu_run_out}"
out="${GPU_RUN_WORK:-/tmp/gpu_run_work}/${1:-default}-$$"
mkdir -p "$out" "$dest"
pack() {
  trap - EXIT TERM INT
  tar czf "$dest/gpu_run-${phases[0]:-default}.tgz" -C "$out" . 2>/dev/null
  cp "$out/phases.txt" "$out/gpu.txt" "$dest/" 2>/dev/null
  return 0
}
trap pack EXIT
trap 'pack; exit 143' TERM INT
source scripts/gpu_env.sh  # the GPU phases' environment, agentrl importable from this checkout
# Each GPU test failure as it happens (tests/early_failures.py), straight into $OUT: it comes back even when the
# command is killed before the archive is packed.
export AGENTRL_FAILURES_FILE="$dest/failures.txt"
phases=("$@")
[ ${#phases[@]} -gt 0 ] || phases=(extra fixtures tests sft train)
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader | tee "$out/gpu.txt"
# The recipes that fit the card (sft, train, lora, agent-*): glm-air-5b on an H200, glm-air-32e (*-80g.toml) on an H100.
profile_log="$out/gpu.txt" source scripts/gpu_profile.sh || exit 2

keep_run() {  # run folder, destination: what of a run comes back (report, plots, metrics, logs; no weights)
  mkdir -p "$2"
  for item in config.toml metrics.jsonl report.md placement.json weight_updates.jsonl plots logs; do
    cp -r "$1/$item" "$2/" 2>/dev/null || true
  done
}

need_warm() {  # the profile's reverse-text SFT warm start, when this machine has none yet
  [ -f "$warm/agentrl_sft.json" ] || run_phase sft "${SFT_TIMEOUT:-300}" \
    python3 -m agentrl.cli sft --config "cookbook/gpu-1xh200/sft$suffix.toml"
}

agent_rootfs() {  # key-hunt's sandbox root filesystem from this machine's programs (no Docker, no mirror here)
  [ -x /tmp/agentrl-rootfs/key-hunt/bin/sh ] || python3 environments/key_hunt/key_hunt_rootfs.py \
    /tmp/agentrl-rootfs/key-hunt > "$out/agent-rootfs.log" 2>&1
  command -v bwrap >> "$out/agent-rootfs.log" 2>&1 || echo "no bwrap: run the extra phase (.gpu-extra/*.deb)" | tee -a "$out/phases.txt"
}

run_phase() {  # name timeout command...
  local name=$1 limit=$2; shift 2
  local started=$SECONDS
  echo "== $name (limit ${limit}s)"
  timeout --kill-after=15 "$limit" "$@" > "$out/$name.log" 2>&1
  local code=$?
  echo "$name: exit $code in $((SECONDS - started))s" | tee -a "$out/phases.txt"
  tail -15 "$out/$name.log"
}

expanded=()
for phase in "${phases[@]}"; do  # r3deep is its two halves (a call each when they do not fit one together)
  if [[ $phase == r3deep ]]; then expanded+=(r3deep-sft r3deep-train)
  elif [[ $phase == nemo ]]; then expanded+=(nemo-sft nemo-train)
  else expanded+=("$phase"); fi
done
scan_path=""  # set once `extra` installed the scan group (Triton 3.7.1) beside the site
for phase in "${expanded[@]}"; do
  [ -d /tmp/site-scan ] && scan_path=/tmp/site-scan:
  case "$phase" in
    extra)
      run_phase extra "${EXTRA_TIMEOUT:-120}" bash -c 'source scripts/gpu_extra_install.sh && gpu_extra_install' ;;
    fixtures)
      version=$(python3 -c "import vllm; print(vllm.__version__)" 2>/dev/null || echo unknown)
      run_phase fixtures "${FIXTURES_TIMEOUT:-150}" python3 scripts/record_vllm_fixtures.py \
        --out "$out/fixtures/vllm-$version" ;;
    tests)
      # shellcheck disable=SC2086
      run_phase tests "${TESTS_TIMEOUT:-300}" python3 -m pytest tests/gpu/test_loop_gpu.py -q -s -p no:cacheprovider \
        --timeout 280 ${TESTS_ARGS:-} ;;
    sft)
      run_phase sft "${SFT_TIMEOUT:-420}" python3 -m agentrl.cli sft --config "cookbook/gpu-1xh200/sft$suffix.toml" ;;
    train)
      rm -rf "$out/run"
      # shellcheck disable=SC2086
      run_phase train "${TRAIN_TIMEOUT:-540}" python3 -m agentrl.cli train \
        --config "cookbook/gpu-1xh200/train$suffix.toml" -o runs/gpu-1xh200/rl ${TRAIN_ARGS:-}
      keep_run runs/gpu-1xh200/rl "$out/run" ;;
    bench)
      run_phase bench "${BENCH_TIMEOUT:-540}" python3 bench/gpu_loop.py --measure --results "$out/gpu_loop.json" ;;
    evalbench)  # the eval throughput only, on an eager and a CUDA-graphs server (the committed update figures kept)
      cp bench/results/gpu_loop.json "$out/gpu_loop.json"
      run_phase evalbench "${EVALBENCH_TIMEOUT:-480}" python3 bench/gpu_loop.py --measure --eval-only \
        --created-model --results "$out/gpu_loop.json" ;;
    deepipc)  # the update latency of glm-air-deep alone (the committed figures kept)
      cp bench/results/gpu_loop.json "$out/gpu_loop.json"
      run_phase deepipc "${DEEPIPC_TIMEOUT:-300}" python3 bench/gpu_loop.py --measure --updates-only \
        --created-model glm-air-deep --repeats-fs 1 --results "$out/gpu_loop.json" ;;
    gputests)  # the trainer alone: Triton 3.7.1 first when the scan group was carried (fla's backward on Hopper)
      run_phase gputests "${GPUTESTS_TIMEOUT:-120}" env PYTHONPATH="$scan_path${PYTHONPATH:-}" \
        python3 -m pytest tests/gpu/test_trainer_mla_gpu.py \
        tests/gpu/test_trainer_nemotron_gpu.py tests/gpu/test_mamba_scan_gpu.py -q -p no:cacheprovider ;;
    steptime)
      run_phase steptime "${STEPTIME_TIMEOUT:-240}" env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
        python3 bench/step_time_check.py --results "$out/step_time_check.json" ;;
    nemotron)
      run_phase nemotron "${NEMOTRON_TIMEOUT:-300}" env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
        PYTHONPATH="$scan_path${PYTHONPATH:-}" \
        python3 bench/trainer_mfu_nemotron.py --results "$out/trainer_mfu_nemotron.json" ;;
    r3deep-sft)
      run_phase r3deep-sft "${R3DEEP_SFT_TIMEOUT:-300}" python3 -m agentrl.cli sft \
        --config cookbook/gpu-1xh200/r3-deep-sft.toml ;;
    r3deep-train)
      rm -rf runs/gpu-1xh200/r3-deep
      # shellcheck disable=SC2086
      run_phase r3deep-train "${R3DEEP_TRAIN_TIMEOUT:-320}" python3 -m agentrl.cli train \
        --config cookbook/gpu-1xh200/r3-deep-train.toml -o runs/gpu-1xh200/r3-deep ${R3DEEP_ARGS:-}
      keep_run runs/gpu-1xh200/r3-deep "$out/r3-deep-run" ;;
    nemo-sft)  # issue 41 item 4: Nemotron-3 in the one-GPU loop
      run_phase nemo-sft "${NEMO_SFT_TIMEOUT:-300}" python3 -m agentrl.cli sft \
        --config cookbook/gpu-1xh200/nemotron-sft.toml ;;
    nemo-train)
      rm -rf runs/gpu-1xh200/nemotron
      run_phase nemo-train "${NEMO_TRAIN_TIMEOUT:-400}" python3 -m agentrl.cli train \
        --config cookbook/gpu-1xh200/nemotron-train.toml -o runs/gpu-1xh200/nemotron
      keep_run runs/gpu-1xh200/nemotron "$out/nemotron-run" ;;
    lora)  # issue 42: the one-GPU recipe with LoRA (adapters on attention and all experts, served after every step)
      need_warm
      rm -rf runs/gpu-1xh200/lora
      # shellcheck disable=SC2086
      run_phase lora "${LORA_TIMEOUT:-540}" python3 -m agentrl.cli train \
        --config "cookbook/gpu-1xh200/train$suffix.toml" -o runs/gpu-1xh200/lora \
        --set 'trainer.lora={rank=16, alpha=32, targets=["attention","experts","shared_experts"]}' \
        --set inference.lora_adapters=true --set inference.weight_transfer=filesystem --set trainer.optimizer.lr=1e-4 \
        ${LORA_ARGS:-}
      keep_run runs/gpu-1xh200/lora "$out/lora-run"
      # the last adapter's size, not its files: with the experts' adapters they outgrow what a call brings back
      last=$(ls -d runs/gpu-1xh200/lora/weights/v* 2>/dev/null | sort -t v -k2 -n | tail -1)
      [ -n "$last" ] && du -sb "$last" | cut -f1 > "$out/lora-run/adapter_bytes" ;;
    loop-*)
      sets=$(awk -v phase="$phase" '$1 == phase {for (i = 2; i <= NF; i++) printf "--set %s ", $i}' scripts/gpu-loops.txt)
      if [ -z "$sets" ]; then echo "$phase: not in scripts/gpu-loops.txt" | tee -a "$out/phases.txt"; continue; fi
      need_warm
      rm -rf "runs/gpu-1xh200/$phase"
      # shellcheck disable=SC2086
      run_phase "$phase" "${LOOP_TIMEOUT:-360}" python3 -m agentrl.cli train \
        --config "cookbook/gpu-1xh200/train$suffix.toml" -o "runs/gpu-1xh200/$phase" \
        --set "orchestrator.max_steps=${LOOP_STEPS:-20}" $sets ${LOOP_ARGS:-}
      keep_run "runs/gpu-1xh200/$phase" "$out/$phase" ;;
    features)  # the gpu_feature tests: R3 through native KV offload (issue 35), kernel-format updates (issue 41)
      # shellcheck disable=SC2086
      run_phase features "${FEATURES_TIMEOUT:-540}" python3 -m pytest tests/gpu -m gpu_feature -q -s -rs \
        -p no:cacheprovider --timeout 400 ${TESTS_ARGS:-} ;;
    agent-sft)  # issue 36 on the H200: key-hunt's warm start, sandboxes under bwrap (the .deb of `extra`)
      agent_rootfs
      need_warm
      run_phase agent-sft "${AGENT_SFT_TIMEOUT:-420}" python3 -m agentrl.cli sft \
        --config "cookbook/gpu-1xh200/agent-sft$suffix.toml"
      cp "runs/gpu-1xh200/$(basename "$warm" -sft)-key-hunt-sft/agentrl_sft.json" "$out/agent-sft.json" 2>/dev/null ;;
    agent-train)
      agent_rootfs
      rm -rf runs/gpu-1xh200/agent
      # shellcheck disable=SC2086
      run_phase agent-train "${AGENT_TRAIN_TIMEOUT:-540}" python3 -m agentrl.cli train \
        --config "cookbook/gpu-1xh200/agent-train$suffix.toml" -o runs/gpu-1xh200/agent ${AGENT_ARGS:-}
      keep_run runs/gpu-1xh200/agent "$out/agent-run" ;;
    agent-eval)  # the run's last checkpoint against its warm start, 64 held-out tasks x 4
      agent_rootfs
      last=$(ls -d runs/gpu-1xh200/agent/checkpoints/step_* 2>/dev/null | sort -t_ -k2 -n | tail -1)
      run_phase agent-eval "${AGENT_EVAL_TIMEOUT:-420}" python3 -m agentrl.cli eval \
        --config cookbook/gpu-1xh200/agent-eval.toml --model "${last:-runs/gpu-1xh200/agent/checkpoints/none}" \
        -o "$out/agent-eval" ;;
    x2tests)
      # shellcheck disable=SC2086
      run_phase x2tests "${X2TESTS_TIMEOUT:-330}" python3 -m pytest tests/gpu/test_weights_nccl.py -q -s \
        -p no:cacheprovider --timeout 320 ${TESTS_ARGS:-} ;;
    x2train)
      rm -rf runs/gpu-2xh200/rl
      # shellcheck disable=SC2086
      run_phase x2train "${X2TRAIN_TIMEOUT:-420}" python3 -m agentrl.cli train --config cookbook/gpu-2xh200/train.toml \
        -o runs/gpu-2xh200/rl ${TRAIN_ARGS:-}
      keep_run runs/gpu-2xh200/rl "$out/x2-run" ;;
    x2sync)
      rm -rf runs/gpu-2xh200/rl-sync
      run_phase x2sync "${X2SYNC_TIMEOUT:-360}" python3 -m agentrl.cli train --config cookbook/gpu-2xh200/train.toml \
        -o runs/gpu-2xh200/rl-sync --set orchestrator.max_off_policy_steps=0 --set orchestrator.max_steps=16
      keep_run runs/gpu-2xh200/rl-sync "$out/x2-sync-run" ;;
    x2bench)
      run_phase x2bench "${X2BENCH_TIMEOUT:-300}" python3 bench/gpu_loop.py --measure-nccl \
        --results "$out/gpu_loop_x2.json" ;;
    *) echo "unknown phase $phase" ;;
  esac
done
df -h /tmp . | tail -2 >> "$out/gpu.txt"
