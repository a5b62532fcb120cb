# Sourced by the GPU scripts (gpu_run.sh, trainer_gpu_run.sh), from the repository root: agentrl importable
# from this checkout without building it (a package folder whose entries link to sdk/ plus the subpackages),
# with the carried wheels in /tmp/site first on the path.
shim=/tmp/agentrl_shim/agentrl
rm -rf /tmp/agentrl_shim && mkdir -p "$shim"
for f in sdk/*; do ln -s "$PWD/$f" "$shim/"; done
for sub in trainer inference hub; do ln -s "$PWD/$sub" "$shim/$sub"; done
export PYTHONPATH=/tmp/site:/tmp/agentrl_shim:$PWD
