"""Model code for the trainer: GLM-4.5 / Qwen3-MoE decoder, router, attention, HF adapter."""
