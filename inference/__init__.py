"""agentrl.inference: vLLM launch plans, server processes, weight updates, router."""
