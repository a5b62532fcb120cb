"""`import agentrl` and `import agentrl.hub` must not pull in torch, vllm or ray."""

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
    ],
)
def test_import_is_light(statement):
    code = f"{statement}\nimport sys\nprint(','.join(m for m in {HEAVY!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"{statement} imported heavy modules: {out.stdout.strip()}"
