"""Shared fixtures for the trainer's tests."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).parent))

from trainer_helpers import make_hf_folder, tiny_deepseek_config, tiny_glm_config, tiny_nemotron_config  # noqa: E402


@pytest.fixture(scope="session")
def tiny_glm_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-glm")
    make_hf_folder(path, tiny_glm_config())
    return path


@pytest.fixture(scope="session")
def tiny_nemotron_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-nemotron-h")
    make_hf_folder(path, tiny_nemotron_config())
    return path


@pytest.fixture(scope="session")
def tiny_deepseek_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-deepseek")
    make_hf_folder(path, tiny_deepseek_config())
    return path
