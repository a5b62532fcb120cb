"""The model families the trainer knows: the one table from ``model_type`` to `Family` (torch-free).

Each family is one module beside this one (its ``config.json`` reading, its model class, its
state-dict adapter) and one row of `FAMILIES`; everything in the trainer that differs by architecture
goes through this table (`MoEModelArgs.from_hf_config`, `build.build_model`, `state_dict`). A family
from elsewhere (a test, a plugin) joins with `register_family`.
"""

from __future__ import annotations

from typing import Any

from agentrl.errors import AgentrlError
from agentrl.trainer.models.families import deepseek_v3, glm4_moe, nemotron_h, qwen3_moe
from agentrl.trainer.models.family import Family

__all__ = ["FAMILIES", "family_for_config", "family_of", "register_family", "supported_model_types"]

FAMILIES: dict[str, Family] = {family.model_type: family for family in (
    glm4_moe.FAMILY,
    qwen3_moe.FAMILY,
    nemotron_h.FAMILY,
    deepseek_v3.FAMILY,
)}
"""model_type -> Family: the families the trainer builds, reads and writes."""


def register_family(family: Family, *, replace: bool = False) -> Family:
    """Add a family to the table (``replace``: over one of the same model_type)."""
    if family.model_type in FAMILIES and not replace:
        raise AgentrlError(f"model family {family.model_type!r} is already registered; pass replace=True")
    FAMILIES[family.model_type] = family
    return family


def supported_model_types() -> tuple[str, ...]:
    """Every ``config.json`` model_type the table reads (families, then their other names)."""
    return tuple(FAMILIES) + tuple(alias for family in FAMILIES.values() for alias in family.config_types)


def family_of(model_type: str) -> Family:
    """The family named ``model_type`` (`MoEModelArgs.model_type`)."""
    family = FAMILIES.get(model_type)
    if family is None:
        raise AgentrlError(f"model_type {model_type!r} has no model family in the trainer; "
                           f"use one of {', '.join(FAMILIES)}")
    return family


def family_for_config(config: dict[str, Any]) -> Family:
    """The family that reads a Hugging Face ``config.json`` dict: by architecture, else by model_type."""
    architectures = set(config.get("architectures") or [])
    for family in FAMILIES.values():
        if architectures & set(family.architectures):
            return family
    model_type = config.get("model_type")
    for family in FAMILIES.values():
        if model_type == family.model_type or model_type in family.config_types:
            return family
    raise AgentrlError(f"config.json model_type {model_type!r} is not supported by the trainer; "
                       f"use one of {', '.join(supported_model_types())}")
