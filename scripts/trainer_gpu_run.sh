#!/usr/bin/env bash
# One trainer GPU session on a lent H200 machine (docs/gpu.md): install the carried wheels,
# make agentrl importable from this checkout, run the trainer's GPU tests, then the MFU bench.
# Usage (repo root, wheels in .whl/): OUT=dir bash scripts/trainer_gpu_run.sh [bench args]
#    or: OUT=dir bash scripts/trainer_gpu_run.sh --x8 [args]   # 8-GPU scaling run, bench/trainer_mfu_x8.py, no tests
#    or: OUT=dir bash scripts/trainer_gpu_run.sh --step-time   # bench/step_time_check.py (predicted vs measured), no tests
set -uo pipefail
out="${OUT:-/tmp/trainer_gpu_out}"
x8=0
step_time=0
if [ "${1:-}" = "--x8" ]; then x8=1; shift; SKIP_TESTS="${SKIP_TESTS:-1}"; fi
if [ "${1:-}" = "--step-time" ]; then step_time=1; shift; SKIP_TESTS="${SKIP_TESTS:-1}"; fi
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
source scripts/agentrl_shim.sh  # agentrl importable from this checkout
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.cuda.device_count(), 'GPUs')"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout "${TEST_TIMEOUT:-240}" python3 -m pytest tests/gpu/test_trainer_gpu.py -x -q -p no:cacheprovider \
    2>&1 | tee "$out/gpu_tests.log" | tail -25
fi
if [ "$x8" = 1 ]; then
  # the bench starts no row past --time-limit-s (530 s), kills a launch 20 s after it, and
  # writes its JSON straight into $OUT after every launch (kept even if the call is cut short)
  timeout "${BENCH_TIMEOUT:-575}" python3 bench/trainer_mfu_x8.py --results "$out/trainer_mfu_x8.json" "$@" \
    2>&1 | tee "$out/bench_x8.log" | tail -40
  exit 0
fi
if [ "$step_time" = 1 ]; then
  timeout "${BENCH_TIMEOUT:-560}" python3 bench/step_time_check.py --results "$out/step_time_check.json" "$@" \
    2>&1 | tee "$out/step_time_check.log" | tail -40
  exit 0
fi
timeout "${BENCH_TIMEOUT:-330}" python3 bench/trainer_mfu.py "$@" 2>&1 | tee "$out/bench.log" | tail -40
cp bench/results/trainer_mfu.json "$out/" 2>/dev/null || true
