"""Model families are data: a family defined in this file joins the table and the trainer builds, trains and exports it.

The toy family is a Qwen3-MoE variant without qk-norm, under its own model_type, with its own model class;
nothing in `agentrl.trainer` names it. The other tests pin the table itself: every preset names a family
the table reads from its config, and no trainer module outside the table compares model types.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from trainer_helpers import make_samples

from agentrl.errors import AgentrlError
from agentrl.trainer.models.args import MoEModelArgs
from agentrl.trainer.models.common import MoEDecoder
from agentrl.trainer.models.families import FAMILIES, family_for_config, qwen3_moe, register_family
from agentrl.trainer.models.family import Family

TOY_CONFIG = {
    "model_type": "toy_qwen3_moe", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128,
    "moe_intermediate_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2, "mlp_only_layers": [0], "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6, "norm_topk_prob": True, "tie_word_embeddings": False,
}


class ToyDecoder(MoEDecoder):
    """The toy family's model: the common decoder, its own class."""


def toy_args(config: dict) -> dict:
    """Qwen3-MoE's fields without qk-norm, under the toy model_type."""
    return {**qwen3_moe.args_from_hf(config), "model_type": "toy_qwen3_moe", "use_qk_norm": False}


TOY = Family(model_type="toy_qwen3_moe", args_from_hf=toy_args, decoder=ToyDecoder,
             weights="agentrl.trainer.models.decoder_weights")


@pytest.fixture
def toy_family():
    register_family(TOY)
    try:
        yield TOY
    finally:
        FAMILIES.pop(TOY.model_type, None)


def test_a_family_from_this_file_trains_and_exports(toy_family, tmp_path):
    from agentrl.trainer.config import TrainerConfig
    from agentrl.trainer.models.build import build_model, init_weights
    from agentrl.trainer.models.state_dict import hf_to_native, read_hf_state, save_hf_weights
    from agentrl.trainer.trainer import Trainer

    args = MoEModelArgs.from_hf_config(TOY_CONFIG)
    assert (args.model_type, args.use_qk_norm, args.score_func, args.dense_layers) == (
        "toy_qwen3_moe", False, "softmax", [0])
    model = build_model(args)
    assert type(model) is ToyDecoder and not any("q_norm" in name for name, _ in model.named_parameters())
    init_weights(model, std=0.2, seed=3)
    folder = save_hf_weights(model.state_dict(), tmp_path / "toy", args=args)
    (folder / "config.json").write_text(json.dumps(TOY_CONFIG))

    trainer = Trainer(TrainerConfig(row_tokens=64, loss={"mode": "sft"}, optimizer={"lr": 1e-2}),
                      model_dir=folder, device="cpu")
    assert type(trainer.model) is ToyDecoder
    batch = trainer.pack(make_samples(with_experts=False))
    nll = [trainer.step(batch)["nll"] for _ in range(4)]
    assert nll[-1] < nll[0] - 0.1, nll

    exported = trainer.export_hf(tmp_path / "export", dtype=torch.float32)
    native = hf_to_native(read_hf_state(exported), args)
    trained = trainer.model.state_dict()
    assert set(native) == set(trained)
    for name, tensor in trained.items():
        torch.testing.assert_close(native[name], tensor, atol=0, rtol=0)


def test_the_table_names_registered_families_in_its_errors(toy_family):
    with pytest.raises(AgentrlError, match=r"model_type 'llama' is not supported .*toy_qwen3_moe"):
        MoEModelArgs.from_hf_config({"model_type": "llama"})
    with pytest.raises(AgentrlError, match="already registered"):
        register_family(TOY)


def test_every_preset_names_the_family_that_reads_its_config():
    from agentrl.models import PRESETS

    for spec in PRESETS.values():
        config = {"architectures": [spec.architecture], **(spec.hf_config or {})}
        assert spec.family in FAMILIES, spec.name
        assert family_for_config(config).model_type == spec.family, spec.name


def test_no_trainer_module_outside_the_table_compares_model_types():
    trainer = Path(__file__).resolve().parents[3] / "trainer"
    table = trainer / "models" / "families" / "__init__.py"
    pattern = re.compile(r"model_type\s*(==|!=|\bin\b|\bnot in\b)")
    found = [f"{path.relative_to(trainer)}:{number}" for path in sorted(trainer.rglob("*.py")) if path != table
             for number, line in enumerate(path.read_text().splitlines(), start=1) if pattern.search(line)]
    assert found == []
