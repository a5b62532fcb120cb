"""vLLM's metrics from its Prometheus text (`GET /metrics`), each summed over its label sets.

vLLM exports a counter `vllm:<name>` as samples `vllm:<name>_total{engine=...,model_name=...}` (one per engine and
label set) beside `vllm:<name>_created` timestamps, and a gauge as samples named `vllm:<name>`. The tests, benches
and diagnostics that ask "how many prompt tokens came from the prefix cache, or through the KV connector, during
this request" read a counter before and after it; this module is the one place that parses that text (with
prometheus_client's parser, which vLLM itself depends on). Names are given without `_total`, e.g.
``vllm:external_prefix_cache_hits`` or ``vllm:num_requests_running``.
"""

from __future__ import annotations

from collections.abc import Iterable

import httpx

from agentrl.errors import require

__all__ = ["afetch_metric", "afetch_metric_sums", "fetch_metric_sums", "metric_sums"]


def metric_sums(text: str, names: Iterable[str]) -> dict[str, float]:
    """Prometheus text -> {name: the sum of its samples (`<name>_total` of a counter, `<name>` of a gauge) over
    all label sets}, 0.0 for a name the text does not hold (vLLM creates some only once a feature is on, e.g. the
    KV connector's counters)."""
    parser = require("prometheus_client.parser", "cpu")  # a vLLM dependency, in either extra

    sums = dict.fromkeys(names, 0.0)
    for family in parser.text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name.removesuffix("_total")  # a counter's samples; a gauge's have no suffix
            if name in sums:
                sums[name] += float(sample.value)
    return sums


def fetch_metric_sums(url: str, *names: str, timeout_s: float = 30.0) -> dict[str, float]:
    """`metric_sums` of `names` on the server at `url` now."""
    response = httpx.get(f"{url}/metrics", timeout=timeout_s)
    response.raise_for_status()
    return metric_sums(response.text, names)


async def afetch_metric_sums(client: httpx.AsyncClient, url: str, *names: str) -> dict[str, float]:
    """`metric_sums` of `names` on the server at `url` now, through an open async client."""
    response = await client.get(f"{url}/metrics")
    response.raise_for_status()
    return metric_sums(response.text, names)


async def afetch_metric(client: httpx.AsyncClient, url: str, name: str) -> float:
    """One metric's sum over its label sets on the server at `url` now (`afetch_metric_sums` of one name)."""
    return (await afetch_metric_sums(client, url, name))[name]
