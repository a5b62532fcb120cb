"""What the orchestrator says when a run goes wrong: one line naming the problem and what to do.

- `RunFailedError` / `describe_failure`: the orchestrator raises `RunFailedError` after
  `max_failed_steps` steps in a row without a usable rollout; its message is one line naming
  the failed steps, the first error, how many rollouts had an error of the same kind (errors
  that differ only in their numbers count as one) and, from `failure_hint`, what to do about
  it: a prompt longer than the model's context (agentrl's client's and vLLM's own wording,
  with both numbers), a missing sandbox image (`agentrl env check`), no Docker engine,
  unreachable or failing inference (its log in the run folder).
- `TrainerOutOfMemoryError` / `out_of_memory_error`: a trainer rank ran out of GPU memory; one line
  with the step, the trainer's and the other processes' (a vLLM server sharing the GPU) memory and
  the settings that lower them.
- `ReplayCoverage`: Router Replay's coverage across a run's steps. Once some step's samples
  carried routed experts, every step's metrics hold `r3/replayed_fraction` (the trainer's
  share of loss tokens whose experts were replayed; NaN for a failed step), and the first
  step below 1 warns once (`RuntimeWarning`, also `r3/warning` in its metrics) with
  `replay_warning`'s reasons: the trainer's `replay_skipped_*` counts and the samples
  without routed experts (all of them: inference stopped returning them).
"""

from __future__ import annotations

import math
import re
import warnings
from typing import Any

from agentrl.errors import AgentrlError
from agentrl.types import TrainingSample

__all__ = ["ReplayCoverage", "RunFailedError", "TrainerOutOfMemoryError", "describe_failure", "failure_hint",
           "out_of_memory_error", "replay_warning"]


class RunFailedError(AgentrlError):
    """`max_failed_steps` steps in a row had no usable rollout; the message names the first error and a fix."""

    def __init__(self, message: str, *, history: list[dict[str, Any]] | None = None) -> None:
        super().__init__(message)
        self.history = history or []
        """The metrics of every step this run delivered, the failed ones included."""


class TrainerOutOfMemoryError(AgentrlError):
    """A trainer rank ran out of GPU memory (the run stops: exit status 1)."""

    exit_code = 1


def out_of_memory_error(*, step: int, rank: int, peak_gib: float, reserved_gib: float,
                        others_gib: float | None, total_gib: float, row_tokens: int) -> TrainerOutOfMemoryError:
    """The one line of a trainer rank's CUDA out-of-memory error at `step` (GiB figures: the trainer's tensors at
    their peak and what its allocator held, the other processes on its GPU, the GPU's size)."""
    others = f", other processes on the GPU (a vLLM server sharing it) {others_gib:.1f} GiB" if others_gib else ""
    return TrainerOutOfMemoryError(
        f"trainer-{rank} ran out of GPU memory at step {step}: trainer peak {peak_gib:.1f} GiB (its allocator held "
        f"{reserved_gib:.1f} GiB){others}, GPU {total_gib:.1f} GiB; lower inference.gpu_memory_utilization (the "
        f"server's share of a shared GPU) or trainer.row_tokens (now {row_tokens}), or give the trainer its own "
        "GPU (launch.colocate = false); agentrl train --dry-run prints the memory plan"
    )


_NUMBERS = re.compile(r"\d[\d,]*")
_CLIENT_TOO_LONG = re.compile(r"prompt of [\d,]+ tokens (?:exceeds|fills)")  # agentrl.clients.token_client.TokenClient
_VLLM_TOO_LONG = (  # vLLM's own 400 answers: (pattern, group of the prompt length, group of the context)
    (re.compile(r"maximum context length is (\d+) tokens\. However, your prompt contains (?:at least )?(\d+)"), 2, 1),
    (re.compile(r"prompt \(length (\d+)\).*?maximum model length of (\d+)"), 1, 2),
)
_CONTEXT_FIX = "use a model with a longer context, shorter prompts (the environment's args), or inference.max_model_len"
_NO_IMAGE = re.compile(r"sandbox image .* is not in the local Docker engine|ImageNotFound|No such image", re.I)
_NO_DOCKER = re.compile(r"no Docker engine answers|Cannot connect to the Docker daemon")
_UNREACHABLE = re.compile(r"ConnectError|ConnectTimeout|Connection refused|All connection attempts failed|"
                          r"RemoteProtocolError|Server disconnected|ReadError|ReadTimeout|PoolTimeout|"
                          r"Name or service not known|inference server (?:\S+ )?lost|was restarting")
_SERVER_FAILED = re.compile(r"answered 5\d\d")


def failure_hint(error: str, *, env_name: str | None = None) -> str:
    """What to do about a rollout error, chosen from its text."""
    if _CLIENT_TOO_LONG.search(error):
        return _CONTEXT_FIX  # the error already has both numbers and the model's name
    for pattern, prompt_group, context_group in _VLLM_TOO_LONG:
        match = pattern.search(error)
        if match:
            prompt, context = int(match.group(prompt_group)), int(match.group(context_group))
            return f"prompt of {prompt:,} tokens exceeds the model's context of {context:,}: {_CONTEXT_FIX}"
    if _NO_IMAGE.search(error):
        return f"build it: agentrl env check {env_name or '<env>'} lists what is missing"
    if _NO_DOCKER.search(error):
        return "start the Docker engine (dockerd) or give the environment another sandbox type"
    if _UNREACHABLE.search(error):
        return "inference is unreachable: check that the vLLM server is up (its log is in the run folder's logs/)"
    if _SERVER_FAILED.search(error):
        return "the inference server failed the requests: see its log in the run folder's logs/"
    return "see the run folder's logs/"


def _error_kind(error: str) -> str:
    """Errors that differ only in their numbers (token counts, ports, ids) count as one."""
    return _NUMBERS.sub("#", " ".join(error.split()))


def describe_failure(errors: list[str | None], *, steps: list[int], env_name: str | None = None) -> str:
    """One line for `RunFailedError`: the failed steps, the first error, how many rollouts had it, a fix.

    `errors` holds one entry per rollout of the failed steps (None: no error, but no usable sample).
    """
    span = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]}"
    head = f"no usable rollout in {len(steps)} step{'s' if len(steps) != 1 else ''} in a row ({span})"
    first = next((error for error in errors if error), None)
    if first is None:
        return (f"{head}: {len(errors)} rollouts ended without an error but with no model turn to train on; "
                "see the run folder's logs/")
    kind = _error_kind(first)
    same = sum(1 for error in errors if error and _error_kind(error) == kind)
    shown = " ".join(first.split())
    if len(shown) > 400:
        shown = shown[:400] + "..."
    return f"{head}: {same} of {len(errors)} rollouts failed with {shown}: {failure_hint(first, env_name=env_name)}"


def replay_warning(step: int, fraction: float, train_metrics: dict[str, Any], carried: int, samples: int) -> str:
    """Why Router Replay covered less than all loss tokens of a step, as far as the metrics tell."""
    from_trainer = {key.removeprefix("replay_skipped_"): float(value) for key, value in train_metrics.items()
                    if key.startswith("replay_skipped_") and float(value) > 0}
    reasons = []
    if carried < samples:
        tokens = from_trainer.get("no_experts")
        reasons.append(f"{samples - carried} of {samples} samples carried no routed experts"
                       + (f" ({tokens:,.0f} loss tokens)" if tokens else ""))
    labels = {
        "no_experts": "of samples without routed experts",
        "layout": "of samples whose routed experts do not fit a packed row (their (layers, top_k) is not the "
                  "model's MoE layers and top_k)",
        "unknown": "whose routed experts were unknown (-1) or missing",
        "router_replay_off": "not replayed because trainer.router_replay is off",
    }
    for reason, count in from_trainer.items():
        if reason == "no_experts" and carried < samples:
            continue  # said already, in samples
        reasons.append(f"{count:,.0f} loss tokens {labels.get(reason, f'skipped ({reason})')}")
    if not reasons:
        reasons.append("the trainer gave no reason (no replay_skipped_* metrics)")
    if math.isnan(fraction):
        return (f"Router Replay: step {step}'s samples carried routed experts but the trainer reported no "
                "replayed_fraction; its routing may be live")
    shown = f"{fraction:.1%}" if fraction < 0.999 else f"{fraction:.3%}"  # never a rounded 100.0%
    return (f"Router Replay replayed {shown} of step {step}'s loss tokens although its samples carried "
            f"routed experts: {'; '.join(reasons)}")


class ReplayCoverage:
    """Router Replay's coverage across a run's steps: `r3/replayed_fraction` per step, one warning."""

    def __init__(self) -> None:
        self.seen = False
        """Some step's samples carried routed experts."""
        self.warned = False
        """The run's one warning was given."""

    def step_metrics(self, step: int, samples: list[TrainingSample],
                     train_metrics: dict[str, Any]) -> dict[str, Any]:
        """`r3/replayed_fraction` once samples carry routed experts; warn once when it is below 1."""
        carried = sum(1 for sample in samples if sample.routed_experts is not None)
        self.seen = self.seen or carried > 0
        if not self.seen:
            return {}
        if not samples:  # a failed step: nothing trained, nothing replayed
            return {"r3/replayed_fraction": float("nan")}
        if carried == 0:
            fraction = 0.0
            message = (f"Router Replay: step {step}'s samples carried no routed experts although earlier steps' "
                       "did; inference stopped returning them, so the trainer routed every token live")
        else:
            fraction = float(train_metrics.get("replayed_fraction", float("nan")))
            message = replay_warning(step, fraction, train_metrics, carried, len(samples))
        metrics: dict[str, Any] = {"r3/replayed_fraction": fraction}
        nothing_to_replay = float(train_metrics.get("loss_tokens", 1.0)) == 0.0
        if (math.isnan(fraction) or fraction < 1.0) and not nothing_to_replay and not self.warned:
            self.warned = True
            metrics["r3/warning"] = message
            warnings.warn(message, RuntimeWarning, stacklevel=2)
        return metrics
