"""Chat clients that environments talk to: vLLM token-in/token-out, and OpenAI-compatible.

`TokenClient` renders messages with the model's own tokenizer and chat template, sends
prompt token ids to vLLM's `/inference/v1/generate` (the scale-out endpoint, enabled by
`--enable-scale-out`) and decodes the answer into a `Completion`: completion ids, the
sampled tokens' logprobs, `routed_experts` (base64 `.npy` -> `RoutedExperts`, when the server returns them)
and per-token `weight_versions` (vLLM reports version spans). Multi-turn: with `previous`
the prompt is `previous.prompt_token_ids + previous.completion.token_ids` followed by the
tokens of the newly added messages only, so nothing the model saw is re-tokenized.
Concurrent identical calls (a group's first turns) share one request with `n` choices
(`agentrl.clients.coalesce`); seeded ones when their seeds run consecutively (vLLM seeds choice `i`
with `seed + i`, so each choice is what its own seeded request would have been). Requests
carry `cache_salt` = the newest weight version the client has seen (asked once from
`/weight_info`, then read from responses), so vLLM's prefix cache never hands a request KV
blocks computed by weights older than its own start
(weight updates keep the KV of requests in flight, `agentrl.inference.weights`). With `prefill_url`
(prefill/decode disaggregation) each request is prefilled there first and the prompt's routing is
stitched from both answers (`agentrl.clients.prefill_decode`).

`OpenAIClient` (`agentrl.clients.openai_client`, importable from here too) speaks
`/v1/chat/completions` to any OpenAI-compatible endpoint.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import httpx
import msgspec

from agentrl.chat import ChatRenderer, assistant_message
from agentrl.clients.coalesce import RequestCoalescer
from agentrl.clients.http_pool import ShardedAsyncClient
from agentrl.clients.openai_client import OpenAIClient
from agentrl.clients.prefill_decode import PrefillStitch, decode_body, prefill_body
from agentrl.clients.session import current_trajectory
from agentrl.errors import ContextLengthError, InferenceError
from agentrl.routed import RoutedExperts, decode_routed_experts_array, routing_arrays, split_routed_experts
from agentrl.sampling import SamplingConfig
from agentrl.types import Completion, Message, Turn

__all__ = ["ContextLengthError", "InferenceError", "OpenAIClient", "TokenClient", "decode_routed_experts",
           "expand_weight_versions"]


_GREEDY_BELOW = 1e-5
"""vLLM samples greedily below this temperature (and then refuses n > 1)."""
_JSON_CONTENT = {"content-type": "application/json"}


def expand_weight_versions(spans: list[dict[str, Any]] | None, length: int) -> list[int] | None:
    """vLLM's `[{version, start, end}]` spans -> one int version per output token.

    Versions are strings in vLLM; numeric ones become ints, the initial 'default' is 0.
    """
    if not spans:
        return None
    versions = [0] * length
    for span in spans:
        version = _version_number(span.get("version", "0"))
        for index in range(max(0, int(span["start"])), min(length, int(span["end"]))):
            versions[index] = version
    return versions


def _version_number(raw: Any) -> int:
    """A vLLM weight version string as an int ('default' and other names are 0)."""
    try:
        return int(str(raw))
    except ValueError:
        return 0


_REFUSED_CONTEXT = (
    re.compile(r"maximum context length is (\d+) tokens"),  # vllm/renderers/params.py
    re.compile(r"longer than the maximum model length of (\d+)"),  # vllm/v1/engine/input_processor.py
)


def _context_in_refusal(text: str) -> int | None:
    """The context length named by vLLM's 400 answer to a prompt too long for the model; None for other refusals."""
    for pattern in _REFUSED_CONTEXT:
        match = pattern.search(text)
        if match:
            return int(match.group(1))
    return None


def decode_routed_experts(encoded: str | None) -> RoutedExperts | None:
    """vLLM's base64 `.npy` routed experts -> `RoutedExperts` (tokens, layers, top_k); None stays None."""
    rows = decode_routed_experts_array(encoded)
    return None if rows is None else RoutedExperts(*routing_arrays(rows))


def _vllm_sampling_params(sampling: SamplingConfig, *, max_tokens: int) -> dict[str, Any]:
    params: dict[str, Any] = {
        "max_tokens": max_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": max(0, sampling.top_k),
        "logprobs": 0,  # the sampled token's logprob only
        # RequestOutputKind.FINAL_ONLY: every choice in the one answer. vLLM 0.32 sets it for unstreamed
        # requests itself; 0.24 leaves CUMULATIVE, and with n > 1 its answer then holds only the choices
        # that finished in the engine's last step (seen on the H200: "asked for 8 choices, got 2").
        "output_kind": 2,
    }
    if sampling.seed is not None:
        params["seed"] = sampling.seed
    if sampling.stop:
        params["stop"] = list(sampling.stop)
    else:
        params["detokenize"] = False
    if sampling.ignore_eos:
        params["ignore_eos"] = True
    return params


_PD_RESENDS = 15
"""P/D: how many times a request whose prefill and decode ran on different weight versions is sent again, waiting
0.1 s more each time up to 1 s (about 10 s in all: the two servers' updates end within that)."""


class TokenClient:
    """Token-in/token-out chat client for a vLLM server started with `--enable-scale-out`."""

    def __init__(
        self,
        base_url: str,
        *,
        model: str | Path = "tiny-moe",
        renderer: ChatRenderer | None = None,
        served_model_name: str | None = None,
        max_connections: int = 256,
        timeout_s: float = 600.0,
        api_key: str | None = None,
        parse_tools: bool = True,
        coalesce: bool = True,
        prefill_url: str | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/").removesuffix("/v1")
        self.model = str(model)
        self._renderer = renderer
        self.served_model_name = served_model_name
        self.adapter_version: int | None = None
        """Set by `use_adapter`: every token of a request naming the adapter is of this policy version."""
        self.parse_tools = parse_tools
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = ShardedAsyncClient(
            base_url=self.base_url, timeout=httpx.Timeout(timeout_s, connect=10.0),
            max_connections=max_connections, headers=headers,
        )
        # P/D asks each choice on its own prefill: as n choices of one decode request, each would pull the one
        # prefill's KV, which a connector that hands it over by reference (NIXL) frees after the first pull.
        self._coalescer = RequestCoalescer() if coalesce and not prefill_url else None
        self.prefill_url = prefill_url.rstrip("/").removesuffix("/v1") if prefill_url else None
        """P/D: every request is prefilled here first and `base_url` (decode) loads its KV
        (`clients.prefill_decode`, which stitches the prompt's routing from both answers)."""
        self.prefill_http = None if self.prefill_url is None else ShardedAsyncClient(
            base_url=self.prefill_url, timeout=httpx.Timeout(timeout_s, connect=10.0),
            max_connections=max_connections, headers=headers)
        self.prefill_stitch = PrefillStitch()
        self.max_model_len: int | None = None
        self._context_lookup: asyncio.Future | None = None
        self._context_looked_up = False
        self.weight_version: int | None = None
        """The newest weight version seen from the server (None: it reports none); salts requests."""

    @property
    def renderer(self) -> ChatRenderer:
        """The chat renderer (loads the model's tokenizer on first use)."""
        if self._renderer is None:
            from agentrl.models import ensure_model

            self._renderer = ChatRenderer.from_pretrained(ensure_model(self.model))
        return self._renderer

    async def _context_length(self) -> int | None:
        """The server's max_model_len, asked once per client (with the served weight version, `_ask_server`).

        Concurrent first calls await one shared lookup, so they all resume in the same turn
        of the event loop (and a group's first requests can still be coalesced).
        """
        if self.max_model_len is not None or self._context_looked_up:
            return self.max_model_len
        if self._context_lookup is None:
            self._context_lookup = asyncio.ensure_future(self._ask_server())
        lookup = self._context_lookup
        try:
            await asyncio.shield(lookup)
        except BaseException:
            if lookup.done() and self._context_lookup is lookup:
                self._context_lookup = None  # the lookup itself failed: the next call asks again
            raise
        return self.max_model_len

    async def _ask_server(self) -> None:
        """max_model_len and the served weight version (servers without RL endpoints report none)."""
        try:
            response = await self.http.get("/v1/models")
            response.raise_for_status()
            self.max_model_len = int(response.json()["data"][0].get("max_model_len") or 0) or None
        except (httpx.HTTPError, KeyError, IndexError, ValueError):
            pass  # unknown: the server enforces its own limit and answers with an error
        try:
            response = await self.http.get("/weight_info")
            if response.status_code == 200:
                self._note_version(response.json().get("weight_version"))
        except (httpx.HTTPError, ValueError):
            pass
        self._context_looked_up = True

    def _note_version(self, raw: Any) -> None:
        version = _version_number(raw)
        if self.weight_version is None or version > self.weight_version:
            self.weight_version = version

    # ------------------------------------------------------------------ tokens
    def prompt_ids(
        self, messages: list[Message], *, tools: list[dict[str, Any]] | None = None, previous: Turn | None = None,
    ) -> list[int]:
        """Prompt token ids: a full render, or `previous`'s tokens extended by the new messages."""
        if previous is None:
            return self.renderer.render(messages, tools=tools)
        last_assistant = max((i for i, m in enumerate(messages) if m.role == "assistant"), default=None)
        if last_assistant is None:
            raise ValueError("previous turn given but the conversation has no assistant message")
        return self.renderer.extend(
            previous.prompt_token_ids + previous.completion.token_ids, messages,
            last_assistant=last_assistant, tools=tools,
        )

    def use_adapter(self, name: str, version: int) -> None:
        """Name the LoRA adapter `name` in requests sent from now on, and take their tokens as of policy `version`:
        a server shared by several runs holds one adapter per run and version (its weight version is not this
        run's), so a request's version is the one its adapter was published as."""
        self.served_model_name, self.adapter_version = name, version

    async def generate(
        self, prompt_ids: list[int], *, sampling: SamplingConfig,
    ) -> tuple[Completion, RoutedExperts | None]:
        """One completion of `prompt_ids`: the Completion and the prompt's routed experts.

        Non-greedy calls with the same prompt and sampling made in the same turn of the event
        loop and the same `trajectory_session` (a group's first turns) share one
        `/inference/v1/generate` request with `n` choices (`coalesce`): unseeded calls all,
        seeded calls by runs of consecutive seeds (choice `i` is seeded `seed + i` by vLLM, as
        the request seeded `seed + i` alone); greedy calls always have a request of their own.
        """
        max_tokens = sampling.max_tokens
        context = await self._context_length()
        if context is not None:
            room = context - len(prompt_ids)
            if room <= 0:
                raise self._too_long(len(prompt_ids), context)
            max_tokens = min(max_tokens, room)
        params = _vllm_sampling_params(sampling, max_tokens=max_tokens)
        if self._coalescer is not None and sampling.temperature >= _GREEDY_BELOW:
            # vLLM takes n > 1 only when sampling; calls of different trajectory sessions keep
            # their own requests (each goes to its session's replica behind a router)
            unseeded = {name: value for name, value in params.items() if name != "seed"}
            key = (tuple(prompt_ids), json.dumps(unseeded, sort_keys=True), current_trajectory(),
                   sampling.seed is not None)

            def send(n: int, first_seed: int | None) -> Any:
                seeded = unseeded if first_seed is None else {**unseeded, "seed": first_seed}
                return self._generate_choices(prompt_ids, seeded, n=n)

            choice = await self._coalescer.submit(key, send, seed=sampling.seed)
        else:
            choice = (await self._generate_choices(prompt_ids, params, n=1))[0]
        return self._completion(choice, prompt_ids)

    async def _generate_choices(self, prompt_ids: list[int], params: dict[str, Any], *, n: int,
                                resent: int = 0) -> list[dict[str, Any]]:
        """`n` choices of one `/inference/v1/generate` request (P/D: sent again, up to `_PD_RESENDS` times a little
        later, while the decode server began with other weights than the prefill server computed the prompt's KV
        with: the two servers finish a weight update at slightly different moments)."""
        body: dict[str, Any] = {
            "token_ids": prompt_ids,
            "sampling_params": {**params, "n": n} if n > 1 else params,
            "output_mode": "tokens",
        }
        version = self.adapter_version  # read with the name: the pair the request is sent with
        if self.served_model_name:
            body["model"] = self.served_model_name
        if self.weight_version is not None:
            body["cache_salt"] = f"agentrl-weights-v{self.weight_version}"
        prefill_answer = None
        if self.prefill_http is not None:
            prefill_answer = await self._prefill(body)
            body = decode_body(body, prefill_answer)
            if version is not None:  # a named adapter: both answers are of its version, as the decode's below
                for choice in prefill_answer["choices"]:
                    choice["weight_versions"] = [{"version": str(version), "start": 0, "end": 1}]
        try:
            response = await self.http.post("/inference/v1/generate", content=msgspec.json.encode(body),
                                            headers=_JSON_CONTENT)
        except httpx.HTTPError as exc:
            raise InferenceError(f"{self.base_url}/inference/v1/generate: {type(exc).__name__}: {exc}") from exc
        if response.status_code == 400 and n > 1 and "sampling_params.n must be at most" in response.text:
            # more choices than the server's max_num_seqs: ask for two halves instead (seeded:
            # the second half starts at the seed its first choice has in the whole request)
            later = params if params.get("seed") is None else {**params, "seed": params["seed"] + n // 2}
            first, second = await asyncio.gather(
                self._generate_choices(prompt_ids, params, n=n // 2),
                self._generate_choices(prompt_ids, later, n=n - n // 2),
            )
            return first + second
        if response.status_code == 400:
            context = _context_in_refusal(response.text)
            if context is not None:  # vLLM's own length check (the context was not known here)
                raise self._too_long(len(prompt_ids), context, refused=True)
        if response.status_code != 200:
            raise InferenceError(
                f"{self.base_url}/inference/v1/generate answered {response.status_code}: {response.text[:300]}",
                status=response.status_code,
            )
        try:  # msgspec: the logprobs of every token make these bodies large, json.loads is 2.7x slower
            choices = msgspec.json.decode(response.content)["choices"]
        except (msgspec.DecodeError, KeyError, TypeError) as exc:
            raise InferenceError(f"{self.base_url}/inference/v1/generate answered 200 without a JSON body of "
                                 f"choices: {response.text[:200]!r}") from exc
        if len(choices) != n:
            raise InferenceError(f"{self.base_url}/inference/v1/generate: asked for {n} choices, got {len(choices)}",
                                 retryable=False)
        for choice in choices:
            if version is not None:
                choice["weight_versions"] = [{"version": str(version), "start": 0,
                                              "end": len(choice.get("token_ids") or [])}]
            for span in choice.get("weight_versions") or []:
                self._note_version(span.get("version"))
        if n > 1 and all("index" in choice for choice in choices):
            choices = sorted(choices, key=lambda choice: choice["index"])  # choice i is the one seeded seed + i
        if prefill_answer is not None:
            if resent < _PD_RESENDS and not self.prefill_stitch.same_version(choices, prefill_answer):
                self.prefill_stitch.resent += 1  # a weight update between the two calls
                await asyncio.sleep(min(0.1 * (resent + 1), 1.0))
                return await self._generate_choices(prompt_ids, params, n=n, resent=resent + 1)
            self.prefill_stitch.stitch_choices(choices, prefill_answer)
        return choices

    async def _prefill(self, body: dict[str, Any]) -> dict[str, Any]:
        """P/D's first call: the prompt computed on the prefill server, its KV kept for the decode server."""
        url = f"{self.prefill_url}/inference/v1/generate"
        try:
            response = await self.prefill_http.post("/inference/v1/generate",
                                                    content=msgspec.json.encode(prefill_body(body)),
                                                    headers=_JSON_CONTENT)
        except httpx.HTTPError as exc:
            raise InferenceError(f"{url} (prefill): {type(exc).__name__}: {exc}") from exc
        if response.status_code == 400:
            context = _context_in_refusal(response.text)
            if context is not None:
                raise self._too_long(len(body["token_ids"]), context, refused=True)
        if response.status_code != 200:
            raise InferenceError(f"{url} (prefill) answered {response.status_code}: {response.text[:300]}",
                                 status=response.status_code)
        try:
            answer = msgspec.json.decode(response.content)
        except msgspec.DecodeError as exc:
            raise InferenceError(f"{url} (prefill) answered 200 without a JSON body: {response.text[:200]!r}") from exc
        if not isinstance(answer, dict) or not answer.get("choices"):
            raise InferenceError(f"{url} (prefill) answered 200 without choices: {response.text[:200]!r}")
        return answer

    def _too_long(self, prompt_tokens: int, context: int, *, refused: bool = False) -> ContextLengthError:
        """One line with both numbers: `prompt of 5,210 tokens exceeds tiny-moe's context of 2,048 tokens`."""
        model = self.served_model_name or Path(self.model).name or self.model
        verb = "exceeds" if prompt_tokens > context else "fills (no room to generate)"
        message = f"prompt of {prompt_tokens:,} tokens {verb} {model}'s context of {context:,} tokens"
        return ContextLengthError(message + (" (vLLM refused the request)" if refused else ""),
                                  prompt_tokens=prompt_tokens, context_tokens=context)

    def _completion(self, choice: dict[str, Any], prompt_ids: list[int]) -> tuple[Completion, RoutedExperts | None]:
        token_ids = list(choice.get("token_ids") or [])
        logprobs = [entry["logprob"] for entry in ((choice.get("logprobs") or {}).get("content") or [])]
        rows = decode_routed_experts_array(choice.get("routed_experts"))
        prompt_experts = None
        completion_experts = None
        if rows is not None:
            # vLLM covers every forwarded token: prompt + completion minus the last sampled one (-1 here).
            ids, weights = routing_arrays(rows)
            prompt_rows, completion_rows = split_routed_experts(
                ids, prompt_len=len(prompt_ids), completion_len=len(token_ids), strict=False,
            )
            prompt_weights = completion_weights = None
            if weights is not None:
                prompt_weights, completion_weights = split_routed_experts(
                    weights, prompt_len=len(prompt_ids), completion_len=len(token_ids), strict=False)
            prompt_experts = RoutedExperts(prompt_rows, prompt_weights)
            completion_experts = RoutedExperts(completion_rows, completion_weights)
        completion = Completion(
            text=self.renderer.decode(token_ids, skip_special_tokens=True),
            token_ids=token_ids,
            logprobs=logprobs,
            routed_experts=completion_experts,
            policy_versions=expand_weight_versions(choice.get("weight_versions"), len(token_ids)),
            finish_reason=choice.get("finish_reason"),
        )
        return completion, prompt_experts

    async def chat(
        self,
        messages: list[Message],
        *,
        tools: list[dict[str, Any]] | None = None,
        sampling: SamplingConfig,
        previous: Turn | None = None,
    ) -> tuple[Message, Turn]:
        """The assistant's next message (tool calls parsed) and the turn's tokens."""
        prompt_ids = self.prompt_ids(messages, tools=tools, previous=previous)
        completion, prompt_experts = await self.generate(prompt_ids, sampling=sampling)
        message = assistant_message(completion.text, parse_tools=self.parse_tools and bool(tools))
        return message, Turn(prompt_token_ids=prompt_ids, completion=completion, prompt_routed_experts=prompt_experts)

    async def aclose(self) -> None:
        if self._coalescer is not None:
            await self._coalescer.aclose()
        await self.http.aclose()
        if self.prefill_http is not None:
            await self.prefill_http.aclose()

    async def __aenter__(self) -> TokenClient:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.aclose()

