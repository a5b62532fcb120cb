"""agentrl.clients: how environments reach a model.

- `token_client.py`: `TokenClient`, token ids in and out of vLLM (logprobs, routed experts, policy versions);
- `openai_client.py`: `OpenAIClient`, any `/v1/chat/completions` endpoint;
- `coalesce.py`: a group's identical calls as one request with `n` choices;
- `http_pool.py`: the clients' HTTP transport over small httpx pools;
- `session.py`: the rollout's id in `X-Session-ID`, for the router's session affinity.
"""
