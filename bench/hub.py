"""Benchmark of the environment hub: push, no-op re-push and verified pull, local and Hugging Face backends.

    python3 bench/hub.py [--rows 50000]

Workload: a generated package whose `data/train.jsonl` has `--rows` task rows (plus the
built-in reverse-text environment, generator based). Every figure is a ratio against a
baseline measured in the same run on the same package:

- push (validate + parquet + stage + atomic publish) against the baseline "convert the rows
  to parquet with `datasets` and copy the folder" (the work any publish must do);
- a re-push of unchanged content (a no-op) against the full push;
- pull with every file's sha256 verified against a plain copy of the stored version;
- the HF backend (through `huggingface_hub`, against the Hub-compatible server of the tests on
  127.0.0.1) against the local backend, for push and pull.

Prints a rich table and writes bench/results/hub.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "hub.json"


def timed(function, *args, repeat: int = 1, **kwargs) -> tuple[float, object]:
    """Best wall time of `repeat` calls, and the last result."""
    best, result = float("inf"), None
    for _ in range(repeat):
        start = time.perf_counter()
        result = function(*args, **kwargs)
        best = min(best, time.perf_counter() - start)
    return best, result


def baseline_publish(package: Path, out: Path) -> None:
    """What any publish must do: read the rows, write them as parquet, copy the folder (pyarrow, no cache)."""
    import pyarrow.json
    import pyarrow.parquet

    shutil.copytree(package, out)
    table = pyarrow.json.read_json(str(package / "data" / "train.jsonl"))
    pyarrow.parquet.write_table(table, str(out / "train.parquet"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=50_000, help="Task rows in the generated package.")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="agentrl-bench-hub-"))
    os.environ["AGENTRL_HUB"] = str(work / "hub")
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    os.environ["HF_HOME"] = str(work / "hf-home")
    from tests.fakes.hf_hub_server import FakeHubServer

    server = FakeHubServer().start()
    os.environ["HF_ENDPOINT"] = server.endpoint
    os.environ["HF_TOKEN"] = "hf_fake_token_alice"
    import huggingface_hub.constants as hf_constants

    hf_constants.ENDPOINT = server.endpoint
    hf_constants.HUGGINGFACE_CO_URL_TEMPLATE = server.endpoint + "/{repo_id}/resolve/{revision}/{filename}"

    from agentrl.hub.hf import HFHub
    from agentrl.hub.local import LocalHub
    from agentrl.hub.publish import pull_package, push_package
    from tests.fakes.toy_package import write_toy_package

    rows: list[dict] = []
    try:
        package = write_toy_package(work / "pkg", name="bench-pkg", rows=args.rows)
        size_mb = sum(p.stat().st_size for p in package.rglob("*") if p.is_file()) / 1e6
        local, hf = LocalHub(), HFHub()

        counter = iter(range(1000))

        def fresh_baseline():
            baseline_publish(package, work / f"baseline-{next(counter)}")

        def fresh_local_push():  # a new hub each time, so every repetition publishes
            return push_package(package, hub=LocalHub(work / f"hub-{next(counter)}"), owner="alice")

        def fresh_hf_push():  # a new repo each time
            return push_package(package, hub=hf, owner="alice", name=f"bench-pkg-{next(counter)}")

        base_s, _ = timed(fresh_baseline, repeat=2)
        push_s, _ = timed(fresh_local_push, repeat=2)
        _, result = timed(push_package, package, hub=local, owner="alice")
        noop_s, again = timed(push_package, package, hub=local, owner="alice", repeat=3)
        assert result.published and not again.published
        stored = local.packages_dir / "alice" / "bench-pkg" / "0.1.0"
        copy_s, _ = timed(
            lambda: (shutil.rmtree(work / "copy", ignore_errors=True), shutil.copytree(stored, work / "copy")), repeat=3
        )
        pull_s, _ = timed(pull_package, "alice/bench-pkg", hub=local, destination=work / "pulled", repeat=3)
        hf_push_s, _ = timed(fresh_hf_push, repeat=2)
        push_package(package, hub=hf, owner="alice")
        hf_pull_s, _ = timed(pull_package, "alice/bench-pkg", hub=hf, destination=work / "pulled-hf", repeat=3)

        builtin = ROOT / "environments" / "reverse_text"
        builtin_push_s, _ = timed(push_package, builtin, hub=local, owner="builtin")
        builtin_pull_s, _ = timed(pull_package, "builtin/reverse-text", hub=local, destination=work / "rt", repeat=3)

        rows = [
            {"measure": f"push, {args.rows} rows ({size_mb:.1f} MB)", "value_s": push_s,
             "baseline": "pyarrow parquet + copy", "baseline_s": base_s, "ratio": push_s / base_s},
            {"measure": "re-push unchanged (no-op)", "value_s": noop_s, "baseline": "full push",
             "baseline_s": push_s, "ratio": noop_s / push_s},
            {"measure": "pull + verify every sha256", "value_s": pull_s, "baseline": "plain copy",
             "baseline_s": copy_s, "ratio": pull_s / copy_s},
            {"measure": "HF backend push", "value_s": hf_push_s, "baseline": "local push",
             "baseline_s": push_s, "ratio": hf_push_s / push_s},
            {"measure": "HF backend pull + verify", "value_s": hf_pull_s, "baseline": "local pull",
             "baseline_s": pull_s, "ratio": hf_pull_s / pull_s},
            {"measure": "push built-in reverse-text (generator)", "value_s": builtin_push_s, "baseline": "-",
             "baseline_s": None, "ratio": None},
            {"measure": "pull built-in reverse-text", "value_s": builtin_pull_s, "baseline": "-",
             "baseline_s": None, "ratio": None},
        ]
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)

    table = Table(title="agentrl hub")
    for column in ("measure", "seconds", "baseline", "baseline s", "ratio"):
        table.add_column(column)
    for row in rows:
        table.add_row(row["measure"], f"{row['value_s']:.3f}", row["baseline"],
                      "" if row["baseline_s"] is None else f"{row['baseline_s']:.3f}",
                      "" if row["ratio"] is None else f"{row['ratio']:.2f}x")
    Console(width=120).print(table)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"rows": args.rows, "results": rows}, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
