#!/usr/bin/env bash
# The one-GPU check (issue 34): the GPU tests and the committed one-H200 recipe, judged against baselines.
# On a lent H200, after the bundle is carried (../shared/gpu/make-gpu-bundle.sh; the last call also carries
# .gpu-extra/ from scripts/gpu_extra.sh and .gpu-bundle/assemble.sh):
#   source .gpu-bundle/assemble.sh && OUT=$OUT GPU_CHECK_COMMIT=<commit> bash scripts/gpu_check.sh [PHASE ...]
# Phases, in the order given (default: extra sft train tests-loop tests-rest compare), each under its own timeout:
#   extra    the wheels the image and the bundle lack (scripts/gpu_extra.sh: .gpu-extra/, and the groups whose
#            parts were carried to /tmp/acc-GROUP/) into /tmp/site, once per machine and group
#   sft      the recipe's SFT warm start (cookbook/gpu-1xh200/sft.toml), only when runs/gpu-1xh200/glm-air-5b-sft
#            is missing (it stays on a warm machine between calls)
#            On a card under 100 GiB (an H100; or GPU_CHECK_PROFILE=80g) sft and train take the 80g profile instead:
#            sft-80g.toml and train-80g.toml, glm-air-32e (glm-air-5b with 32 experts), since glm-air-5b needs 124 GiB
#   tests    python3 -m pytest tests/gpu (all but the gpu_feature tests, which gpu_run.sh runs; tests needing
#            two GPUs skip on one) -> tests.log; more than one 600 s call holds now (on an H100 at 6281702 five
#            tests took 370 s: each starts its own CUDA vLLM server), so the check runs it in two parts instead:
#   tests-loop   tests/gpu/test_loop_gpu.py (the servers: routed experts, gate weights, IPC, FP8) -> tests-loop.log
#   tests-rest   the other tests/gpu files (trainer kernels, Mamba scan, MLA, Nemotron) -> tests-rest.log
#   train    agentrl train --config cookbook/gpu-1xh200/train.toml as committed, 30 steps, into the next
#            /tmp/gpu_check/runs/run-N, with the GPU's per-process memory sampled every 5 s (gpu_memory.csv);
#            its checkpoint is deleted after (10 GB), the rest packed into $OUT/run-N.tgz
#   compare  python3 bench/gpu_check.py over every run so far and every tests*.log -> $OUT/gpu_check.json (copy
#            it to bench/results/gpu_check.json and commit it)
# A machine given back loses /tmp: the runs of earlier calls are in their $OUT archives. One 600 s device call
# holds about: extra + sft + train (480 s); tests-loop (give it 540); tests-rest + compare. The whole check is
# then about 1,300 s of device time with the carry calls and the start.
set -uo pipefail
dest="${OUT:-/tmp/gpu_check_out}"
work=/tmp/gpu_check
mkdir -p "$dest" "$work/runs"
source scripts/gpu_env.sh  # the GPU phases' environment, agentrl importable from this checkout
# Each GPU test failure as it happens (tests/early_failures.py): this file comes back even when a phase is killed.
export AGENTRL_FAILURES_FILE="$dest/failures.txt"
phases=("$@")
[ ${#phases[@]} -gt 0 ] || phases=(extra sft train tests-loop tests-rest compare)
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader | tee "$work/gpu.txt"
# The recipe that fits the card: glm-air-5b on an H200, glm-air-32e (the *-80g.toml files) on an H100;
# bench/gpu_check.py judges each against that profile's own baselines.
profile_log="$work/gpu.txt" source scripts/gpu_profile.sh || exit 2
cp "$work/gpu.txt" "$dest/"

run_phase() {  # name timeout log command...
  local name=$1 limit=$2 log=$3; shift 3
  local started=$SECONDS
  echo "== $name (limit ${limit}s)"
  timeout --kill-after=15 "$limit" "$@" > "$log" 2>&1
  local code=$?
  echo "$name: exit $code in $((SECONDS - started))s" | tee -a "$work/phases.txt"
  tail -12 "$log"
  return $code
}

sample_memory() {  # file: every 5 s, the time and each GPU process's memory (MiB)
  while true; do
    echo "# $(date +%s)"
    nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits 2>/dev/null
    sleep 5
  done >> "$1"
}

for phase in "${phases[@]}"; do
  case "$phase" in
    extra)
      bash scripts/machine_facts.sh > "$work/machine_facts.txt" 2>&1  # for the sandboxes' plan (bwrap, no Docker)
      run_phase extra "${EXTRA_TIMEOUT:-120}" "$work/extra.log" bash -c 'source scripts/gpu_extra_install.sh &&
        gpu_extra_install' ;;
    sft)
      if [ -f "$warm/agentrl_sft.json" ]; then
        echo "sft: warm start already here"
      else
        run_phase sft "${SFT_TIMEOUT:-300}" "$work/sft.log" python3 -m agentrl.cli sft \
          --config "cookbook/gpu-1xh200/sft$suffix.toml"
      fi ;;
    tests|tests-loop|tests-rest)
      case "$phase" in
        tests) files=(tests/gpu) ;;
        tests-loop) files=(tests/gpu/test_loop_gpu.py) ;;
        tests-rest) mapfile -t files < <(ls tests/gpu/test_*.py | grep -v '/test_loop_gpu.py$') ;;
      esac
      # shellcheck disable=SC2086
      run_phase "$phase" "${TESTS_TIMEOUT:-540}" "$work/$phase.log" python3 -m pytest "${files[@]}" -q -s -rs \
        -p no:cacheprovider --timeout 300 -m "not gpu_feature" ${TESTS_ARGS:-}
      cp "$work/$phase.log" "$dest/" ;;
    train)
      n=1
      while [ -e "$work/runs/run-$n" ]; do n=$((n + 1)); done
      run="$work/runs/run-$n"
      mkdir -p "$run"
      sample_memory "$run/gpu_memory.csv" &
      sampler=$!
      started=$SECONDS
      run_phase "train-$n" "${TRAIN_TIMEOUT:-480}" "$run/train.log" python3 -m agentrl.cli train \
        --config "cookbook/gpu-1xh200/train$suffix.toml" -o "$run/folder"
      echo $? > "$run/exit_code"
      echo $((SECONDS - started)) > "$run/phase_seconds"
      kill "$sampler" 2>/dev/null
      # The run folder's files beside the script's own; its checkpoint (10 GB of weights) is not kept.
      rm -rf "$run/folder/checkpoints" "$run/folder/weights"
      cp -r "$run/folder/." "$run/" 2>/dev/null && rm -rf "$run/folder"
      tar czf "$dest/run-$n.tgz" -C "$work/runs" "run-$n" ;;
    compare)
      # shellcheck disable=SC2046
      python3 bench/gpu_check.py $(ls -d "$work"/runs/run-* | sort -V) \
        $(for log in "$work"/tests*.log; do [ -f "$log" ] && echo --tests-log "$log"; done) \
        --commit "${GPU_CHECK_COMMIT:-unknown}" --device "$(head -1 "$work/gpu.txt")" --profile "$profile" \
        --results "$dest/gpu_check.json" | tee "$work/compare.txt" ;;
    *) echo "unknown phase $phase" ;;
  esac
done
cp "$work/phases.txt" "$dest/" 2>/dev/null
cp "$work/machine_facts.txt" "$dest/" 2>/dev/null
true
