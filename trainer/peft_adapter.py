"""A LoRA run's adapters as a PEFT folder: ``adapter_config.json`` + ``adapter_model.safetensors``.

The layout transformers + peft (``PeftModel.from_pretrained(base, folder)``) and vLLM's LoRA loader
read: tensors ``base_model.model.<module>.lora_A.weight`` ``(r, in)`` and ``...lora_B.weight``
``(out, r)``, where ``<module>`` is the base model's Hugging Face module name. Those names come from
the family table's own state-dict adapter (`state_dict.native_to_hf`): each adapter's ``A`` (and
``B``) stack is mapped as if it were the weight it adapts, so a stacked expert adapter ``(E, r, in)``
comes out per expert (``...mlp.experts.<e>.gate_proj``), as the HF checkpoints name experts.

``adapter_config.json`` is written by peft's own `LoraConfig` (rank, ``lora_alpha``, target module
names, the base model folder). Dropout acts only in training; it is written as 0 when routed experts
are adapted, since peft 0.21 refuses dropout on the fused expert parameters transformers 5 loads
them into.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from agentrl.trainer.models.args import MoEModelArgs

__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "peft_adapter_tensors", "save_peft_adapter"]

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def peft_adapter_tensors(state: Mapping[str, torch.Tensor], args: MoEModelArgs) -> dict[str, torch.Tensor]:
    """PEFT's names -> tensors of every adapter in a full trainer state dict (`checkpoint.full_state_dict`)."""
    from agentrl.trainer.models.lora import adapted_weights
    from agentrl.trainer.models.state_dict import native_to_hf

    out: dict[str, torch.Tensor] = {}
    for base, names in adapted_weights(state).items():
        for part, name in zip(("lora_A", "lora_B"), names):
            for hf_name, tensor in native_to_hf({base: state[name]}, args).items():
                module = hf_name.removesuffix(".weight")
                out[f"base_model.model.{module}.{part}.weight"] = tensor.float().contiguous()
    return out


def save_peft_adapter(trainer, out_dir: str | Path) -> Path | None:
    """Write the trainer's adapters as a PEFT folder at ``out_dir`` (collective; rank 0 writes, the folder appears
    whole or not at all). Returns the folder on rank 0, None elsewhere."""
    import torch.distributed as dist
    from safetensors.torch import save_file

    from agentrl.trainer.checkpoint import full_state_dict
    from agentrl.trainer.models.state_dict import replace_folder

    lora = trainer.config.lora
    if lora is None:
        raise ValueError("save_peft_adapter: this trainer has no trainer.lora adapters")
    tensors = peft_adapter_tensors(full_state_dict(trainer, adapters_only=True), trainer.args)
    written = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        from peft import LoraConfig

        out = Path(out_dir)
        tmp = out.with_name(out.name + ".tmp-adapter")
        tmp.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        modules = sorted({key.split(".")[-3] for key in tensors})
        LoraConfig(
            r=lora.rank, lora_alpha=lora.alpha, target_modules=modules, bias="none", task_type="CAUSAL_LM",
            lora_dropout=0.0 if "experts" in lora.targets else lora.dropout,
            base_model_name_or_path=str(trainer.model_dir) if trainer.model_dir else trainer.config.model,
        ).save_pretrained(str(tmp))
        written = replace_folder(tmp, out)
    if dist.is_initialized():
        dist.barrier()
    return written
