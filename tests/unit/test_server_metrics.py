"""vLLM's Prometheus text read back (`inference/server_metrics.py`): counters and gauges summed over label sets."""

from __future__ import annotations

import pytest

from agentrl.inference.server_metrics import metric_sums

TEXT = "\n".join([
    "# HELP vllm:prompt_tokens_total Number of prefill tokens processed.",
    "# TYPE vllm:prompt_tokens_total counter",
    'vllm:prompt_tokens_total{engine="0",model_name="policy"} 1200.0',
    'vllm:prompt_tokens_total{engine="1",model_name="policy"} 300.0',
    'vllm:prompt_tokens_created{engine="0",model_name="policy"} 1.7e9',
    'vllm:prompt_tokens_cached_total{engine="0",model_name="policy"} 800.0',
    'vllm:external_prefix_cache_hits_total{engine="0",model_name="policy"} 512.0',
    'vllm:prompt_tokens_by_source_total{engine="0",model_name="policy",source="local_compute"} 9.0',
    "# HELP vllm:num_requests_running Number of requests in model execution batches.",
    "# TYPE vllm:num_requests_running gauge",
    'vllm:num_requests_running{engine="0",model_name="policy"} 2.0',
    'vllm:num_requests_running{engine="1",model_name="policy"} 1.0',
    "vllm:num_preemptions_total 3.0",
    "",
])


def test_a_counter_is_its_total_samples_summed_over_labels_and_nothing_else():
    said = metric_sums(TEXT, ["vllm:prompt_tokens", "vllm:prompt_tokens_cached", "vllm:external_prefix_cache_hits",
                              "vllm:num_preemptions"])
    # not the `_created` timestamp, not the `prompt_tokens_by_source` or `prompt_tokens_cached` counters beside it
    assert said == {"vllm:prompt_tokens": 1500.0, "vllm:prompt_tokens_cached": 800.0,
                    "vllm:external_prefix_cache_hits": 512.0, "vllm:num_preemptions": 3.0}


def test_a_gauge_is_summed_over_engines_and_a_missing_metric_is_zero():
    said = metric_sums(TEXT, ["vllm:num_requests_running", "vllm:external_prefix_cache_queries"])
    assert said == {"vllm:num_requests_running": 3.0, "vllm:external_prefix_cache_queries": 0.0}


def test_text_that_is_not_prometheus_is_refused():
    with pytest.raises(ValueError):
        metric_sums("<html>502 Bad Gateway</html>", ["vllm:prompt_tokens"])
