"""agentrl.trainer: torchtitan-based MoE model code, parallelism, RL loss, checkpoints, orchestrator."""
