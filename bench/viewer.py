"""Benchmark of `agentrl view`: how fast a run's page with 1,000 rollouts opens in headless Chromium.

    python3 bench/viewer.py [--rollouts 1000] [--repeat 5] [--folder RUN_OR_EVAL_DIR]

Workload: a run folder of `--rollouts` recorded rollouts (the real arithmetic environment
with tool calls, played by a scripted policy through the real orchestrator loop and written
by `RolloutLog`: `tests/viewer_folders.py`), or any run / eval folder given with `--folder`.
The viewer runs in this process (uvicorn on 127.0.0.1); Debian's chromium loads

- the run page (`#/f/0`: six curves and the list of all its rollouts, 1,000 rows), and
- one rollout (`#/f/0/r/0`: transcript, reward parts, per-token view),

each `--repeat` times from a blank page. The time is the page's own: navigation start to the
moment viewer.js has rendered the route (`performance.now()` then), which includes the API
requests and the rendering; the wall time around selenium's calls is reported beside it.
Target: the 1,000-rollout page under 2 s (median, by both clocks).

Prints a rich table and writes bench/results/viewer.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rich.console import Console
from rich.table import Table

RESULTS = ROOT / "bench" / "results" / "viewer.json"
TARGET_S = 2.0


def _make_run(folder: Path, rollouts: int) -> Path:
    from tests.viewer_folders import arithmetic_run

    per_step = 20
    steps = max(1, -(-rollouts // per_step))
    return arithmetic_run(folder, steps=steps, samples_per_step=per_step, groups_per_step=5)


def _load(driver, url: str) -> tuple[float, float]:
    """(page time, wall time) in seconds for one fresh load of `url`."""
    from tests.browser import open_page

    driver.get("about:blank")
    started = time.perf_counter()
    open_page(driver, url, timeout_s=60)
    wall = time.perf_counter() - started
    return int(driver.execute_script("return document.body.dataset.readyMs")) / 1000, wall


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--folder", type=Path, default=None, help="measure this run or eval folder instead")
    args = parser.parse_args()
    from tests.browser import chromium, missing

    reason = missing()
    if reason is not None:
        print(f"bench/viewer.py: {reason}", file=sys.stderr)
        return 2
    from agentrl.viewer.serve import ViewerServer

    console = Console()
    with tempfile.TemporaryDirectory(prefix="agentrl-viewer-bench-") as tmp:
        folder = args.folder or _make_run(Path(tmp) / "run", args.rollouts)
        driver = chromium()
        try:
            with ViewerServer([folder]) as viewer:
                shown = driver.execute_script("return 0")  # the browser is up before the clock starts
                pages = {"run page (all rollouts)": viewer.url + "#/f/0",
                         "one rollout": viewer.url + "#/f/0/r/0"}
                timings: dict[str, list[tuple[float, float]]] = {}
                for name, url in pages.items():
                    _load(driver, url)  # warm-up: the server's first index of the file, the browser's cache
                    timings[name] = [_load(driver, url) for _ in range(args.repeat)]
                    if name.startswith("run page"):
                        shown = driver.execute_script(
                            "return document.querySelectorAll('#rollout-list tbody tr').length")
                version = driver.capabilities.get("browserVersion", "?")
        finally:
            driver.quit()
    rollouts = shown
    table = Table(title=f"agentrl view in headless Chromium {version}: {rollouts} rollouts")
    for column in ("page", "median (s)", "max (s)", "wall median (s)"):
        table.add_column(column, justify="right" if column != "page" else "left")
    results = {}
    for name, runs in timings.items():
        page = [p for p, _ in runs]
        wall = [w for _, w in runs]
        results[name] = {"page_s": page, "wall_s": wall, "median_s": statistics.median(page),
                         "max_s": max(page),
                         "wall_median_s": statistics.median(wall)}
        table.add_row(name, f"{statistics.median(page):.3f}", f"{max(page):.3f}",
                      f"{statistics.median(wall):.3f}")
    console.print(table)
    run_page = results["run page (all rollouts)"]["median_s"]
    run_wall = results["run page (all rollouts)"]["wall_median_s"]
    ok = run_page < TARGET_S and run_wall < TARGET_S and rollouts >= min(args.rollouts, 1000)
    console.print(f"run page with {rollouts} rollouts: {run_page:.3f} s median in the page, {run_wall:.3f} s "
                  f"around selenium (target < {TARGET_S:g} s, both): {'met' if ok else 'NOT met'}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({
        "benchmark": "viewer", "rollouts_listed": rollouts, "repeat": args.repeat, "target_s": TARGET_S,
        "target_met": ok, "pages": results, "browser": f"chromium {version}",
        "folder": str(args.folder) if args.folder else f"generated: {args.rollouts} arithmetic rollouts",
        "machine": f"{platform.node()} {platform.machine()}, {_cores()} cores",
        "python": platform.python_version(), "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }, indent=2) + "\n")
    console.print(f"wrote {RESULTS.relative_to(ROOT)}")
    return 0 if ok else 1


def _cores() -> int:
    import os

    return os.cpu_count() or 1


if __name__ == "__main__":
    sys.exit(main())
