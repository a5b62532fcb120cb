"""agentrl.hub.interop: other ecosystems' environments run by agentrl's loop.

- Harbor tasks (`harbor*.py`): `agentrl env import harbor`, one trial per rollout, the verifier in a fresh sandbox;
- SWE-bench rows (`swebench*.py`): `agentrl env import swebench`, their images pulled or built;
- verifiers packages (`verifiers*.py`): loaded in process or in a worker on the package's own venv, legacy and
  v1 (Tasksets, hooks, Toolsets as MCP servers).
"""
