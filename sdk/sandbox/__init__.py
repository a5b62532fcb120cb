"""agentrl.sandbox: one async Sandbox interface over Docker, bubblewrap and E2B backends."""
