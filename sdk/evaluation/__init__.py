"""agentrl.evaluation: a model scored on an environment (`agentrl.evaluate`, `agentrl eval`).

- `engine.py`: `evaluate` / `EvalConfig`: bounded concurrency, `results.jsonl`, `summary.json`;
- `summary.py`: `EvalSummary`: reward mean and spread, avg@k, pass@k, tokens, throughput;
- `compare.py`: a checkpoint's evaluation beside its run's base model's, with paired intervals.
"""
