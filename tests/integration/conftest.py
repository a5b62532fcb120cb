"""The integration tests' folder is importable (its helper modules: `cpu_servers`, `sandbox_backends`, ...), as the trainer tests' is."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
