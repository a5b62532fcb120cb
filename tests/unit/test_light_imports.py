"""`import agentrl`, `agentrl.hub` and `agentrl.rl` (the run config and the run plan too) must not pull in torch, vllm or ray."""

import subprocess
import sys

import pytest

HEAVY = ("torch", "vllm", "ray", "transformers", "torchtitan")


@pytest.mark.parametrize(
    "statement",
    [
        "import agentrl",
        "import agentrl.hub",
        "import agentrl.cli",
        "import agentrl, agentrl.types, agentrl.config",
        "import agentrl.rl, agentrl.rl.config, agentrl.rl.orchestrator, agentrl.rl.plan, agentrl.rl.launch, "
        "agentrl.rl.actors, agentrl.rl.resume, agentrl.rl.report, agentrl.rl.sft",
        "import agentrl.rl.loggers, agentrl.rl.rollout_log, agentrl.viewer.app, agentrl.viewer.serve",
        "from agentrl.rl.config import load_run_config; load_run_config()",
        # planning needs no torch: `agentrl train --dry-run` and `trainer-plan` work without the train extra
        "from agentrl.rl.config import load_run_config; from agentrl.rl.plan import plan_run; plan_run(load_run_config())",
        "from agentrl.rl.config import load_run_config; load_run_config(model='glm-4.5-air', env='swe')",
    ],
)
def test_import_is_light(statement):
    code = f"{statement}\nimport sys\nprint(','.join(m for m in {HEAVY!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"{statement} imported heavy modules: {out.stdout.strip()}"
