# Sourced by the one-GPU scripts (gpu_run.sh, gpu_check.sh) from the repository root: the environment every GPU
# phase runs in (caches in /tmp, Triton's autotuning kept, NVLink multicast off as the lent machines require, no
# flashinfer sampler, Ray without auth or usage reports) and agentrl importable from this checkout.
export PYTHONUNBUFFERED=1 AGENTRL_CACHE=/tmp/agentrl-cache AGENTRL_NODE_DIR=/tmp/agentrl-node
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 VLLM_USE_FLASHINFER_SAMPLER=0
export RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0
# Triton keeps each kernel's autotuning result on disk (beside its compiled kernels): fla's
# scan autotunes for over 2 minutes on its first call, and each later process of the session (tests, benches, the
# Nemotron recipe) reads the choice instead of timing every config again.
export TRITON_CACHE_AUTOTUNING=1
source scripts/agentrl_shim.sh  # agentrl importable from this checkout
# Libraries of the Debian packages the extra phase unpacks (libibverbs, libnl: mooncake_master's).
for lib in /tmp/site/debs/usr/lib/x86_64-linux-gnu /tmp/site/debs/lib/x86_64-linux-gnu; do
  [ -d "$lib" ] && export LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
done
