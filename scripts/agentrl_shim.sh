# Sourced by the GPU scripts (gpu_run.sh, trainer_gpu_run.sh), from the repository root: agentrl importable
# from this checkout without building it (a package folder whose entries link to sdk/ plus the subpackages),
# with the carried wheels in /tmp/site first on the path, and a dist-info naming agentrl's vLLM plugin (pyproject's
# entry point), which vLLM loads in every process: it acts only on the AGENTRL_* variables a plan sets.
root=${AGENTRL_SHIM_DIR:-/tmp/agentrl_shim}
shim=$root/agentrl
rm -rf "$root" && mkdir -p "$shim" "$root/agentrl_shim-0.dist-info"
printf 'Metadata-Version: 2.1\nName: agentrl-shim\nVersion: 0\n' > "$root/agentrl_shim-0.dist-info/METADATA"
printf '[vllm.general_plugins]\nagentrl = agentrl.inference.vllm_plugin:register\n' \
  > "$root/agentrl_shim-0.dist-info/entry_points.txt"
for f in sdk/*; do ln -s "$PWD/$f" "$shim/"; done
for sub in trainer inference hub; do ln -s "$PWD/$sub" "$shim/$sub"; done
export PYTHONPATH=/tmp/site:$root:$PWD
