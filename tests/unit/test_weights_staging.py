"""Weight publishing without a server: staging checkpoints and the name/shape pre-check."""

from __future__ import annotations

import pytest

from agentrl.inference.weight_staging import check_weights_match, checkpoint_shapes, save_state_dict
from agentrl.inference.weights import FilesystemWeightPublisher, WeightUpdateError

torch = pytest.importorskip("torch")


def test_saved_state_dict_reads_back_and_reports_its_shapes(tmp_path):
    from safetensors.torch import load_file

    state = {"lm_head.weight": torch.arange(6.0).reshape(2, 3), "model.norm.weight": torch.ones(3)}
    folder = save_state_dict(state, tmp_path / "weights-v1")
    assert not (tmp_path / "weights-v1.partial").exists()
    loaded = load_file(str(folder / "model.safetensors"))
    assert all(torch.equal(loaded[name], tensor) for name, tensor in state.items())
    assert checkpoint_shapes(folder) == {"lm_head.weight": (2, 3), "model.norm.weight": (3,)}
    save_state_dict({"lm_head.weight": torch.zeros(2, 3)}, folder)  # overwriting a version replaces it whole
    assert set(load_file(str(folder / "model.safetensors"))) == {"lm_head.weight"}


def test_mismatched_weights_are_one_line_errors(tmp_path):
    served = {"lm_head.weight": (128, 64), "model.norm.weight": (64,)}
    check_weights_match({"lm_head.weight": (128, 64)}, served, source="x")  # a subset is fine
    with pytest.raises(WeightUpdateError, match="'model.bogus'; use the HF checkpoint names"):
        check_weights_match({"model.bogus": (1,)}, served, source="the state dict")
    with pytest.raises(WeightUpdateError, match=r"has shape \[64, 64\], the served model has \[128, 64\]") as info:
        check_weights_match({"lm_head.weight": (64, 64)}, served, source="the state dict")
    assert "\n" not in str(info.value)
    with pytest.raises(WeightUpdateError, match="not a tensor"):
        save_state_dict({"lm_head.weight": [1, 2]}, tmp_path / "bad")
    with pytest.raises(WeightUpdateError, match="no server URLs"):
        FilesystemWeightPublisher([], staging_dir=tmp_path)


def test_unreachable_server_fails_without_staging_leftovers(tmp_path):
    publisher = FilesystemWeightPublisher(["http://127.0.0.1:9"], staging_dir=tmp_path / "staging", timeout_s=5)
    with pytest.raises(WeightUpdateError, match="pause on http://127.0.0.1:9"):
        publisher.publish({"lm_head.weight": torch.zeros(2, 2)}, version=1)
    assert publisher.version is None  # nothing was served, so version 1 can be published again


def test_every_publisher_takes_the_pause_order_that_update_all_passes():
    """`WeightPublisher._update_all` passes each server's update the P/D pause order (`gate`); an override without
    it failed every shared-adapter publish with a TypeError (the e2e shared LoRA server test). Every publisher's
    `_update_one` takes each keyword-only argument of the base's."""
    import inspect

    from agentrl.inference.direct_weights import IpcWeightPublisher, NcclWeightPublisher
    from agentrl.inference.lora_serving import AdapterPublisher, SharedAdapterPublisher
    from agentrl.inference.weights import WeightPublisher

    passed = {name for name, parameter in inspect.signature(WeightPublisher._update_one).parameters.items()
              if parameter.kind is inspect.Parameter.KEYWORD_ONLY}
    assert "gate" in passed
    for publisher in (FilesystemWeightPublisher, AdapterPublisher, SharedAdapterPublisher, IpcWeightPublisher,
                      NcclWeightPublisher):
        assert passed <= set(inspect.signature(publisher._update_one).parameters), publisher.__name__
