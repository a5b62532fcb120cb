"""`agentrl pretrain`: next-token pretraining of a MoE on raw text found on the machine, until its experts specialise.

Router Replay's effect can only be measured on a model whose experts differ in what they
do; created weights do not. This run trains a model (a created one such as `tiny-moe` or
`glm-air-deep`, or any HF folder the trainer loads) on the corpus `agentrl.text_corpus`
finds (by default the installed packages' Python sources), with the model's own tokenizer,
and reports how its routing changed on held-out text (`trainer.routing_figures`):

- the corpus is read, deduplicated and split by file before the model is built (corpus
  errors are one line); documents are joined with the end-of-text token and cut into
  sequences of `trainer.row_tokens` tokens, one per packed row, every token after the first
  a target (the trainer's SFT loss);
- the learning rate warms up linearly over `warmup_steps`, then follows a cosine down to
  `min_lr_ratio` of `trainer.optimizer.lr`;
- routers with a correction bias (GLM-4.5, DeepSeek-V3) are balanced without an auxiliary
  loss, as those models were trained: after each step every expert's bias moves by
  `load_balance_rate` towards the mean load (up when under-loaded, down when over-loaded);
- every `eval_every` steps the held-out NLL and the cheap routing figures are measured; at
  initialisation and at the end the flip cost (`flip_kl`) too.

The output folder holds `model/`, the exported HF model (what `agentrl sft --set model=...` and
vLLM load), `pretrain.json` (config, corpus facts, figures at initialisation and at the end, the
curve), `metrics.jsonl` (one line per step) and `plots/`. A folder that already holds files
is refused, so nothing written before is lost. Same seed and corpus: same run.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import Field, field_validator

from agentrl.config import BaseConfig, over_defaults
from agentrl.errors import AgentrlError
from agentrl.text_corpus import TextCorpusConfig, load_corpus
from agentrl.trainer.config import TrainerConfig
from agentrl.types import TrainingSample

__all__ = ["PretrainConfig", "run_pretrain", "token_stream"]


_PRETRAIN_TRAINER: dict[str, Any] = {"loss": {"mode": "sft"}, "optimizer": {"lr": 3e-3, "weight_decay": 0.01},
                                     "row_tokens": 512, "parallel": {"activation_checkpointing": False}}
"""The trainer defaults of this role; a [trainer] table given is laid over them."""


class PretrainConfig(BaseConfig):
    """A pretraining run on raw text."""

    model: str = "tiny-moe"
    """Model preset or HF folder whose weights are the start (created models: seeded random weights)."""
    corpus: TextCorpusConfig = Field(default_factory=TextCorpusConfig)
    """Which text on this machine is learned, and the held-out share."""
    steps: int = Field(default=300, ge=1)
    """Optimizer steps."""
    batch_rows: int = Field(default=16, ge=1)
    """Sequences (of trainer.row_tokens tokens) per step."""
    warmup_steps: int = Field(default=20, ge=0)
    """Steps of linear learning-rate warm-up."""
    min_lr_ratio: float = Field(default=0.1, ge=0, le=1)
    """The cosine decay's floor, as a share of trainer.optimizer.lr."""
    load_balance_rate: float = Field(default=1e-3, ge=0)
    """Per-step move of each expert's correction bias towards the mean load (0: off)."""
    eval_every: int = Field(default=50, ge=1)
    """Held-out NLL and routing figures every this many steps (and at the end)."""
    heldout_rows: int = Field(default=8, ge=1)
    """Held-out sequences the figures are measured on."""
    flip_layers: int = Field(default=8, ge=0)
    """MoE layers (spread over the depth) whose flip cost is measured at initialisation and at the end."""
    output: str = "runs/pretrain/tiny-moe"
    """Folder written: model/ (the HF export), pretrain.json, metrics.jsonl, plots/ (must be new or empty)."""
    trainer: TrainerConfig = Field(default_factory=lambda: TrainerConfig.model_validate(_PRETRAIN_TRAINER))
    """Trainer settings (loss.mode must be 'sft'; row_tokens is the sequence length)."""
    _trainer_defaults = field_validator("trainer", mode="before")(over_defaults(_PRETRAIN_TRAINER))
    torch_threads: int = Field(default=1, ge=0)
    """CPU threads torch may use (0: torch's default)."""


def token_stream(documents: list[str], tokenizer: Any, *, separator: int | None, needed: int,
                 repeat: bool = True, batch: int = 256) -> tuple[list[int], int]:
    """At least `needed` token ids of the documents in order (separator between them), repeating the
    documents when they hold fewer (unless `repeat` is False: then one pass at most); returns the ids and
    how many passes over the documents were made."""
    ids: list[int] = []
    passes = 0
    while len(ids) < needed and (repeat or passes == 0):
        passes += 1
        for start in range(0, len(documents), batch):
            encoded_batch = tokenizer(documents[start: start + batch], add_special_tokens=False, verbose=False)
            for encoded in encoded_batch["input_ids"]:
                ids += encoded
                if separator is not None:
                    ids.append(separator)
            if len(ids) >= needed:
                break
    return ids, passes


def _samples(ids: list[int], *, length: int, count: int) -> list[TrainingSample]:
    rows = []
    for index in range(count):
        chunk = ids[index * length: (index + 1) * length]
        rest = len(chunk) - 1
        rows.append(TrainingSample(token_ids=chunk, loss_mask=[False] + [True] * rest,
                                   inference_logprobs=[0.0] * len(chunk), policy_versions=[-1] + [0] * rest))
    return rows


def _lr(config: PretrainConfig, step: int) -> float:
    peak = config.trainer.optimizer.lr
    if step < config.warmup_steps:
        return peak * (step + 1) / config.warmup_steps
    span = max(1, config.steps - config.warmup_steps)
    progress = min(1.0, (step - config.warmup_steps) / span)
    return peak * (config.min_lr_ratio + (1 - config.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def _check_output(output: Path) -> None:
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise AgentrlError(f"pretrain: output {output} already holds files; choose a new folder (--set output=...)")


class _LoadBalancer:
    """Counts each router's choices during training steps and moves the correction biases after each step."""

    def __init__(self, blocks: list[Any], rate: float) -> None:
        import torch

        self.blocks = [block for block in blocks if block.expert_bias is not None] if rate > 0 else []
        self.rate = rate
        self.enabled = True
        self.counts = [torch.zeros_like(block.expert_bias) for block in self.blocks]
        self.handles = [block.router.register_forward_hook(self._hook(index)) for index, block in
                        enumerate(self.blocks)]

    def _hook(self, index: int):
        def count(router, inputs, output) -> None:
            if not self.enabled:
                return
            ids = output[1].reshape(-1)
            self.counts[index] += ids.bincount(minlength=self.counts[index].numel()).to(self.counts[index].dtype)
        return count

    def update(self) -> None:
        """Bias up for under-loaded experts, down for over-loaded ones (the sign of mean - load), then reset."""
        import torch

        with torch.no_grad():
            for block, counts in zip(self.blocks, self.counts):
                block.expert_bias += self.rate * torch.sign(counts.mean() - counts)
                counts.zero_()

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def run_pretrain(config: PretrainConfig, *, on_step: Callable[[dict[str, Any]], None] | None = None) -> Path:
    """Pretrain as the module docstring says; returns the output folder."""
    if config.trainer.loss.mode != "sft":
        raise AgentrlError("pretrain: trainer.loss.mode must be 'sft' (next-token cross-entropy)")
    output = Path(config.output)
    _check_output(output)
    corpus = load_corpus(config.corpus)
    from transformers import AutoTokenizer

    from agentrl.models import ensure_model

    model_dir = Path(ensure_model(config.model))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    separator = tokenizer.convert_tokens_to_ids("<|endoftext|>") if "<|endoftext|>" in tokenizer.get_vocab() \
        else tokenizer.eos_token_id
    length = config.trainer.row_tokens
    train_ids, passes = token_stream(corpus.train, tokenizer, separator=separator,
                                     needed=config.steps * config.batch_rows * length)
    heldout_ids, _ = token_stream(corpus.heldout, tokenizer, separator=separator,
                                  needed=config.heldout_rows * length, repeat=False)
    heldout_count = min(config.heldout_rows, len(heldout_ids) // length)
    if heldout_count < 1:
        raise AgentrlError(f"pretrain: the held-out files hold {len(heldout_ids)} tokens, fewer than one sequence of "
                           f"trainer.row_tokens={length}; raise corpus.heldout_fraction or lower trainer.row_tokens")
    facts = dict(corpus.facts, train_tokens_used=config.steps * config.batch_rows * length, train_passes=passes,
                 heldout_tokens=heldout_count * length)

    import torch

    from agentrl.trainer.routing_figures import heldout_figures, token_classes
    from agentrl.trainer.trainer import Trainer

    if config.torch_threads:
        torch.set_num_threads(config.torch_threads)
    trainer = Trainer(config.trainer.model_copy(update={"model": str(model_dir)}), model_dir=model_dir)
    classes = token_classes(tokenizer, trainer.args.vocab_size)
    heldout_rows = trainer.pack(_samples(heldout_ids, length=length, count=heldout_count)).rows

    balancer = _LoadBalancer(trainer.model.moe_blocks(), config.load_balance_rate)

    def figures(flips: int) -> dict[str, Any]:
        balancer.enabled = False  # held-out routing does not move the biases
        try:
            return heldout_figures(trainer, heldout_rows, classes=classes, flip_layers=flips)
        finally:
            balancer.enabled = True

    output.mkdir(parents=True, exist_ok=True)
    initial = figures(config.flip_layers)
    curve = [{"step": 0, "heldout_nll": initial["heldout_nll"], **initial["mean"]}]
    started = time.monotonic()
    metrics_file = (output / "metrics.jsonl").open("w")
    try:
        for step in range(config.steps):
            for group in trainer.optimizer.param_groups:
                group["lr"] = _lr(config, step)
            first = step * config.batch_rows * length
            batch = _samples(train_ids[first: first + config.batch_rows * length], length=length,
                             count=config.batch_rows)
            metrics = trainer.train_on_samples(batch)
            balancer.update()
            record: dict[str, Any] = {"step": step + 1, "nll": metrics["nll"], "lr": _lr(config, step),
                                      "grad_norm": metrics["grad_norm"], "elapsed_s": time.monotonic() - started}
            if (step + 1) % config.eval_every == 0 or step + 1 == config.steps:
                measured = figures(0)
                record.update(heldout_nll=measured["heldout_nll"], **measured["mean"])
                curve.append({"step": step + 1, "heldout_nll": measured["heldout_nll"], **measured["mean"]})
            metrics_file.write(json.dumps(record) + "\n")
            metrics_file.flush()
            if on_step is not None:
                on_step(record)
    finally:
        metrics_file.close()
        balancer.close()
    final = figures(config.flip_layers)
    trainer.export_hf(output / "model", dtype=None)
    summary = {
        "config": json.loads(config.model_dump_json()), "corpus": facts, "train_s": time.monotonic() - started,
        "initial": initial, "final": final, "curve": curve,
        "change": {key: [initial["mean"].get(key), final["mean"].get(key)] for key in final["mean"]}
        | {"heldout_nll": [initial["heldout_nll"], final["heldout_nll"]]},
    }
    (output / "pretrain.json").write_text(json.dumps(summary, indent=1))
    _plot(curve, initial, final, output / "plots")
    return output


def _plot(curve: list[dict[str, Any]], initial: dict[str, Any], final: dict[str, Any], folder: Path) -> None:
    """plots/heldout.png (held-out NLL by step) and plots/specialisation.png (per-layer figures, start and end)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    figure, axis = plt.subplots(figsize=(6, 3.5))
    axis.plot([point["step"] for point in curve], [point["heldout_nll"] for point in curve], marker="o")
    axis.set_xlabel("step")
    axis.set_ylabel("held-out NLL (nats/token)")
    figure.tight_layout()
    figure.savefig(folder / "heldout.png", dpi=100)
    plt.close(figure)
    keys = [key for key in ("router_entropy", "class_nmi", "token_nmi", "load_cv") if key in final["mean"]]
    figure, axes = plt.subplots(1, len(keys), figsize=(3.2 * len(keys), 3.2))
    for axis, key in zip(axes if len(keys) > 1 else [axes], keys):
        for label, figures in (("init", initial), ("final", final)):
            layers = [layer["layer"] for layer in figures["layers"]]
            axis.plot(layers, [layer[key] for layer in figures["layers"]], marker=".", label=label)
        axis.set_title(key)
        axis.set_xlabel("layer")
    axes_list = axes if len(keys) > 1 else [axes]
    axes_list[0].legend()
    figure.tight_layout()
    figure.savefig(folder / "specialisation.png", dpi=100)
    plt.close(figure)
