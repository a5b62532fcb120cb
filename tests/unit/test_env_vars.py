"""Every AGENTRL_* environment variable is registered in `agentrl.env_vars`, and code reads them through it."""

from __future__ import annotations

import re
from pathlib import Path

from agentrl import env_vars

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("sdk", "hub", "inference", "trainer", "environments", "scripts")
NAME = re.compile(r"\bAGENTRL_[A-Z0-9_]+")
NOT_VARIABLES = {"AGENTRL_PATCH_EOF", "AGENTRL_EOF"}
"""Heredoc delimiters of the swe environment's shell commands, not environment variables."""
IN_SANDBOX = {"environments/swe/swe_verdict.py", "sdk/sandbox/sandboxd.py", "sdk/mcp_relay.py",
              "hub/interop/verifier_site.py"}
"""Scripts that run inside a sandbox, where agentrl is not importable: they spell the names."""


def _source_files():
    for folder in SOURCES:
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix in (".py", ".sh") and "tests" not in path.relative_to(ROOT).parts:
                yield path


def test_every_agentrl_variable_in_the_source_is_registered():
    spelled = {name for path in _source_files() for name in NAME.findall(path.read_text())}
    assert spelled - NOT_VARIABLES - set(env_vars.ENV_VARS) == set()
    assert {"AGENTRL_CACHE", "AGENTRL_HUB", "AGENTRL_NODE_DIR", "AGENTRL_CPU_FIXES"} <= spelled


def test_code_reads_them_through_the_registry():
    direct = re.compile(r"""(environ(\.get|\.pop)?\(?\[?|getenv\()\s*["']AGENTRL_""")
    found = [f"{path.relative_to(ROOT)}:{number}" for path in _source_files() if path.suffix == ".py"
             and str(path.relative_to(ROOT)) not in IN_SANDBOX and path.name != "env_vars.py"
             for number, line in enumerate(path.read_text().splitlines(), start=1) if direct.search(line)]
    assert found == []


def test_every_registered_variable_is_documented_and_used():
    spelled = {name for path in _source_files() if path.name != "env_vars.py" for name in NAME.findall(path.read_text())}
    spelled |= {name for path in (ROOT / "tests").rglob("*.py") for name in NAME.findall(path.read_text())}
    for name, var in env_vars.ENV_VARS.items():
        assert name.startswith("AGENTRL_") and var.doc.endswith(".") and len(var.doc) > 20, name
    attribute_of = {value.name: key for key, value in vars(env_vars).items() if isinstance(value, env_vars.EnvVar)}
    code = "\n".join(path.read_text() for path in _source_files() if path.suffix == ".py" and path.name != "env_vars.py")
    used_by_attribute = {name for name, attr in attribute_of.items() if re.search(rf"env_vars\.{attr}\b", code)}
    assert set(env_vars.ENV_VARS) - spelled - used_by_attribute == set()


def test_get_treats_an_empty_value_as_unset_and_raw_keeps_it(monkeypatch):
    var = env_vars.EnvVar("AGENTRL_TEST_REGISTRY_PROBE", "A variable for this test only.", default="fallback")
    monkeypatch.delenv(var.name, raising=False)
    assert (var.get(), var.raw(), var.is_on()) == ("fallback", "fallback", False)
    monkeypatch.setenv(var.name, "")
    assert (var.get(), var.raw()) == ("fallback", "")
    monkeypatch.setenv(var.name, "1")
    assert (var.get(), var.raw(), var.is_on()) == ("1", "1", True)
