"""Counters read from a vLLM server's Prometheus text (`/metrics`), for the integration tests."""

from __future__ import annotations

import httpx


async def vllm_counter(client: httpx.AsyncClient, url: str, name: str) -> float:
    """The sum of counter `name` (e.g. ``vllm:num_preemptions_total``) over all its label sets."""
    text = (await client.get(f"{url}/metrics")).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name):len(name) + 1] in ("{", " "):
            total += float(line.rsplit(" ", 1)[1])
    return total
