"""Config loading: one-line errors naming file:line and key, and `--set` overrides."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import Field

from agentrl.config import BaseConfig, dump_config, load_config, parse_override
from agentrl.errors import ConfigError


class OptimizerConfig(BaseConfig):
    """Optimizer settings."""

    lr: float = 1e-3
    """Learning rate."""
    betas: list[float] = Field(default_factory=lambda: [0.9, 0.99])
    """Adam betas."""


class TrainerConfig(BaseConfig):
    """Trainer settings."""

    steps: int = 10
    """Optimizer steps."""
    optimizer: OptimizerConfig = OptimizerConfig()
    """The optimizer."""


class RunConfig(BaseConfig):
    """A run."""

    name: str = "run"
    """Run name."""
    seed: int | None = None
    """Random seed."""
    trainer: TrainerConfig = TrainerConfig()
    """The trainer."""


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.toml"
    path.write_text(text)
    return path


def _error(tmp_path: Path, text: str | None, overrides: list[str] | None = None) -> str:
    path = _write(tmp_path, text) if text is not None else None
    with pytest.raises(ConfigError) as info:
        load_config(RunConfig, path, overrides=overrides)
    message = str(info.value)
    assert "\n" not in message and "Traceback" not in message
    return message



@pytest.mark.parametrize(("text", "said"), [
    ("steps = 3\n", ":1: unknown key 'steps' (did you mean 'trainer.steps'?)"),  # a key of a table, at the top
    ("lr = 3\n", ":1: unknown key 'lr' (did you mean 'trainer.optimizer.lr'?)"),
    ("[trainer.optimizer]\nsteps = 3\n", ":2: unknown key 'trainer.optimizer.steps' (did you mean 'trainer.steps'?)"),
    ("[trainer]\nnonsense = 3\n", ":2: unknown key 'trainer.nonsense'"),
])
def test_a_key_put_in_the_wrong_table_names_the_table_it_belongs_to(tmp_path, text, said):
    message = _error(tmp_path, text)
    assert message.endswith(said), message


def test_valid_file_and_defaults(tmp_path):
    config = load_config(RunConfig, _write(tmp_path, 'name = "a"\n[trainer.optimizer]\nlr = 0.5\n'))
    assert config.name == "a" and config.trainer.optimizer.lr == 0.5 and config.trainer.steps == 10
    assert load_config(RunConfig) == RunConfig()


def test_unknown_key_names_file_line_and_dotted_key(tmp_path):
    message = _error(tmp_path, 'name = "a"\n\n[trainer]\nsteps = 3\nstepz = 4\n')
    assert message == f"{tmp_path / 'run.toml'}:5: unknown key 'trainer.stepz' (did you mean 'trainer.steps'?)"


def test_unknown_top_level_table(tmp_path):
    message = _error(tmp_path, '[trainr]\nsteps = 3\n')
    assert message.startswith(f"{tmp_path / 'run.toml'}:1: unknown key 'trainr'")


def test_wrong_type_names_file_line_key_and_value(tmp_path):
    message = _error(tmp_path, '[trainer]\nsteps = 1\n[trainer.optimizer]\nlr = "fast"\n')
    assert message == f"{tmp_path / 'run.toml'}:4: trainer.optimizer.lr = 'fast': must be a number"


def test_malformed_toml_names_file_and_line(tmp_path):
    message = _error(tmp_path, 'name = "a"\nseed = = 3\n')
    assert message.startswith(f"{tmp_path / 'run.toml'}: malformed TOML:")
    assert "line 2" in message


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(RunConfig, tmp_path / "nope.toml")


def test_overrides_nested_typed_and_repeated(tmp_path):
    path = _write(tmp_path, '[trainer]\nsteps = 3\n')
    config = load_config(
        RunConfig, path,
        overrides=["trainer.optimizer.lr=2e-5", "trainer.steps=7", "name=hello world", "seed=4",
                   "trainer.optimizer.betas=[0.5, 0.6]", "trainer.steps=8"],
    )
    assert config.trainer.optimizer.lr == 2e-5
    assert config.trainer.steps == 8  # the last override wins
    assert config.name == "hello world"  # not TOML: kept as a string
    assert config.seed == 4
    assert config.trainer.optimizer.betas == [0.5, 0.6]


def test_override_type_error_names_the_override(tmp_path):
    message = _error(tmp_path, '[trainer]\nsteps = 3\n', ["trainer.steps=many"])
    assert message == "--set trainer.steps: trainer.steps = 'many': must be an integer"


def test_override_unknown_key(tmp_path):
    message = _error(tmp_path, None, ["trainer.optimizer.momentum=0.9"])
    assert message == "--set trainer.optimizer.momentum: unknown key 'trainer.optimizer.momentum'"


@pytest.mark.parametrize(
    ("override", "fragment"),
    [("trainer.steps", "expected KEY=VALUE"), ("=3", "the key before '=' is empty"),
     ("name.first=x", "'name' is a value, not a table")],
)
def test_malformed_overrides(tmp_path, override, fragment):
    text = 'name = "a"\n' if override.startswith("name.") else None
    assert fragment in _error(tmp_path, text, [override])


def test_parse_override_values():
    assert parse_override("a.b=3") == (["a", "b"], 3)
    assert parse_override("a=true") == (["a"], True)
    assert parse_override("a=x y") == (["a"], "x y")
    assert parse_override('a="7"') == (["a"], "7")


def test_dump_round_trip(tmp_path):
    config = load_config(RunConfig, overrides=["trainer.steps=5", "name=b"])
    path = _write(tmp_path, dump_config(config))
    assert load_config(RunConfig, path) == config
    assert "seed" not in path.read_text()  # None is left out


class LimitsConfig(BaseConfig):
    """Limits with bounds and units."""

    memory_mb: int = Field(1024, ge=16, json_schema_extra={"unit": "MiB"})
    """Memory in MiB."""


class JobConfig(BaseConfig):
    """A config with a required table and key."""

    name: str
    """Job name."""
    trainer: TrainerConfig = TrainerConfig()
    """The trainer."""
    limits: LimitsConfig = LimitsConfig()
    """Limits."""


def test_every_error_is_reported_wrong_values_first_and_deeper_first(tmp_path):
    path = _write(tmp_path, '[trainer]\nsteps = "many"\nstepz = 1\n[trainer.optimizer]\nlr = "fast"\n'
                            '[limits]\nmemory_mb = 8\n')
    with pytest.raises(ConfigError) as info:
        load_config(JobConfig, path)
    assert str(info.value).split("; ") == [
        f"{path}:5: trainer.optimizer.lr = 'fast': must be a number",
        f"{path}:2: trainer.steps = 'many': must be an integer",
        f"{path}:7: limits.memory_mb = 8: must be at least 16 (MiB)",
        f"{path}:3: unknown key 'trainer.stepz' (did you mean 'trainer.steps'?)",
        f"{path}: missing required key 'name'",
    ]


def test_override_of_a_list_names_the_override_and_the_element(tmp_path):
    message = _error(tmp_path, '[trainer]\nsteps = 3\n', ['trainer.optimizer.betas=[0.9, "x"]'])
    assert message == "--set trainer.optimizer.betas: trainer.optimizer.betas[1] = 'x': must be a number"


def test_long_values_are_cut_to_keep_the_line_short(tmp_path):
    message = _error(tmp_path, f'name = ["{"x" * 200}"]\n')
    assert message == f"{tmp_path / 'run.toml'}:1: name = ['{'x' * 55}...: must be a string"


def test_each_toml_section_is_named_by_its_class():
    """`[inference]` is `InferenceConfig`, `[trainer.optimizer]` is `OptimizerConfig`, `[run]` is `RunSection` (the
    run-only sections say Section; `RunConfig` is the root): one name per section, in code and in TOML."""
    from pydantic import BaseModel

    from agentrl.rl.config import RunConfig

    def sections(model: type[BaseModel], prefix: str = ""):
        for name, field in model.model_fields.items():
            if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
                yield prefix + name, field.annotation
                yield from sections(field.annotation, f"{prefix}{name}.")

    found = dict(sections(RunConfig))
    assert {"inference", "eval", "plan", "trainer.optimizer"} <= set(found)
    for section, model in found.items():
        camel = "".join(part.capitalize() for part in section.rsplit(".", 1)[-1].split("_"))
        assert model.__name__ in (f"{camel}Config", f"{camel}Section"), (section, model.__name__)


def test_a_roles_trainer_defaults_stay_under_a_partial_trainer_table():
    from agentrl.rl.pretrain import PretrainConfig
    from agentrl.rl.sft import SFTConfig

    sft = load_config(SFTConfig, overrides=["trainer.row_tokens=256"])
    assert (sft.trainer.loss.mode, sft.trainer.row_tokens, sft.trainer.optimizer.lr) == ("sft", 256, 3e-3)
    assert sft.trainer.parallel.activation_checkpointing is False
    pretrain = load_config(PretrainConfig, overrides=["trainer.optimizer.lr=1e-3"])
    assert pretrain.trainer.loss.mode == "sft" and pretrain.trainer.optimizer.weight_decay == 0.01
    assert pretrain.trainer.optimizer.lr == 1e-3 and pretrain.trainer.row_tokens == 512
    with pytest.raises(ConfigError, match="row_tokenz"):
        load_config(SFTConfig, overrides=["trainer.row_tokenz=1"])
