"""agentrl.hub: environment package format, local hub, Hugging Face Hub backend, images."""
