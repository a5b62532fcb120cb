"""Generate the `swe` tasks: mutate real projects, keep the mutations their own tests catch.

    python3 environments/swe/swe_generate.py [--seed 0] [--per-project 80] [--parallel 2] [PROJECT ...]

For each project (swe_projects.py) one sandbox is started from its image; the project's
test suite runs once on the clean tree (baseline). Then, for a seeded sample of mutation
sites (swe_mutate.py), the mutated file is written, the test files that touch the module
run, and the file is restored. A mutation becomes a task when at least one
baseline-passing test fails (FAIL_TO_PASS) and every other baseline-passing test of those
files still passes (PASS_TO_PASS, true by construction), without timeouts or collection
errors. The split (train/test) is a hash of project, file and function, so the splits
share no mutated function. Rows go to data/train.jsonl and data/test.jsonl, sorted by
instance id, with generation counts in data/stats.json.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import hashlib
import json
import re
import sys
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from swe_mutate import MutationSite, apply_site, enumerate_sites, select_sites
from swe_projects import PROJECTS, Project, fetch_sdist, get_project
from swe_sandbox import open_sandbox, run_pytest
from swe_task import COMMIT_ENV, GENERATED_TEST_COMMAND, REPO_DIR, commit_message

from agentrl.errors import AgentrlError

__all__ = ["candidate_sites", "generate", "generate_project", "problem_statement", "project_sources", "split_of"]

DATA_DIR = Path(__file__).resolve().parent / "data"
TEST_SHARE = 0.2
MAX_FAIL_TO_PASS_SHOWN = 5


def project_sources(project: Project) -> dict[str, str]:
    """Every .py file of the sdist (path relative to the project root -> text), read on the host."""
    files: dict[str, str] = {}
    with tarfile.open(fetch_sdist(project)) as archive:
        for member in archive.getmembers():
            parts = member.name.split("/", 1)
            if member.isfile() and len(parts) == 2 and parts[1].endswith(".py"):
                files[parts[1]] = archive.extractfile(member).read().decode("utf-8")
    return files


def _under(path: str, roots: tuple[str, ...]) -> bool:
    return any(path == root or path.startswith(root.rstrip("/") + "/") for root in roots)


def mutable_modules(project: Project, sources: dict[str, str]) -> list[str]:
    """Source files whose functions get mutated."""
    return sorted(path for path in sources if _under(path, project.packages)
                  and path not in project.skip_modules and "/tests/" not in path)


def test_files(project: Project, sources: dict[str, str]) -> list[str]:
    """The project's test files (`test_*.py` under its test roots)."""
    return sorted(path for path in sources if _under(path, project.tests) and path.rsplit("/", 1)[-1].startswith("test_"))


def relevant_tests(module: str, tests: list[str], sources: dict[str, str]) -> list[str]:
    """Test files that mention the module by name (all test files when none does)."""
    stem = module.rsplit("/", 1)[-1][:-3]
    name = module.rsplit("/", 2)[-2] if stem == "__init__" else stem
    pattern = re.compile(rf"\b{re.escape(name)}\b")
    chosen = [path for path in tests if pattern.search(sources[path])]
    return chosen or list(tests)


def candidate_sites(project: Project, sources: dict[str, str], *, seed: int, limit: int) -> list[MutationSite]:
    """The seeded sample of mutation sites of a project (deterministic for a seed)."""
    sites: list[MutationSite] = []
    for module in mutable_modules(project, sources):
        sites.extend(enumerate_sites(sources[module], module))
    project_seed = int(hashlib.sha256(f"{seed}:{project.name}".encode()).hexdigest()[:8], 16)
    return select_sites(sites, seed=project_seed, max_per_function=3, limit=limit)


def split_of(project: Project, path: str, function: str) -> str:
    """'test' for about TEST_SHARE of the functions, by hash; 'train' otherwise."""
    digest = hashlib.sha256(f"{project.name}:{path}:{function}".encode()).digest()
    return "test" if digest[0] < 256 * TEST_SHARE else "train"


def _docstring(source: str, function: str) -> tuple[str, str]:
    """(docstring, whose): the function's own docstring ('own'), else its class's ('class'), else ('', '')."""
    tree = ast.parse(source)
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == function:
            text = ast.get_docstring(node) or ""
            return text, "own" if text else ""
        if isinstance(node, ast.ClassDef) and function.startswith(node.name + "."):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and f"{node.name}.{item.name}" == function:
                    if ast.get_docstring(item):
                        return ast.get_docstring(item), "own"
                    text = ast.get_docstring(node) or ""
                    return text, "class" if text else ""
    return "", ""


def _failure_excerpts(output: str, failing: list[str]) -> list[str]:
    """For a few failing tests, the `E ...` lines pytest printed under their headers."""
    sections = re.split(r"^_{3,} (.+?) _{3,}$", output, flags=re.MULTILINE)
    excerpts: list[str] = []
    for title, body in zip(sections[1::2], sections[2::2]):
        errors = [line[1:].strip() for line in body.splitlines() if line.startswith("E ")]
        if errors:
            excerpts.append(f"{title}:\n" + "\n".join(f"    {line}" for line in errors[:6]))
        if len(excerpts) >= 3:
            break
    return excerpts


def problem_statement(project: Project, site: MutationSite, docstring: tuple[str, str], failing: list[str],
                      output: str) -> str:
    """An issue text from the failing tests' output and the function's docstring (never the fix)."""
    kind = "method" if "." in site.function else "function"
    lines = [
        (f"`{site.function}` in `{site.path}` ({project.name} {project.version}) does not behave as documented: "
         f"{len(failing)} test{'s' if len(failing) != 1 else ''} of the project's own suite "
         f"fail{'s' if len(failing) == 1 else ''}."),
        "",
    ]
    text, whose = docstring
    if text.strip():
        doc = "\n".join(text.strip().splitlines()[:15])
        heading = (f"What the {kind} is meant to do (its docstring):" if whose == "own" else
                   f"What its class `{site.function.split('.')[0]}` is meant to do (the class docstring):")
        lines += [heading, "", "    " + doc.replace("\n", "\n    "), ""]
    lines += ["Failing tests:"] + [f"- {node}" for node in failing[:MAX_FAIL_TO_PASS_SHOWN]]
    if len(failing) > MAX_FAIL_TO_PASS_SHOWN:
        lines.append(f"- ... and {len(failing) - MAX_FAIL_TO_PASS_SHOWN} more")
    excerpts = _failure_excerpts(output, failing)
    if excerpts:
        lines += ["", "What they report:", "", *excerpts]
    lines += ["", "Fix the implementation so these tests pass without breaking the others. Do not edit the tests."]
    return "\n".join(lines)


@dataclass
class ProjectStats:
    """Counts of one project's generation."""

    candidates: int = 0
    applied: int = 0
    validated: int = 0
    rejected: dict[str, int] = field(default_factory=dict)
    baseline_tests: int = 0
    seconds: float = 0.0

    def reject(self, reason: str) -> None:
        self.rejected[reason] = self.rejected.get(reason, 0) + 1


async def generate_project(project: Project, *, seed: int, limit: int, test_timeout_s: float = 90.0,
                           log=print) -> tuple[list[dict], ProjectStats]:
    """Validate the project's candidate mutations in one sandbox; return the task rows and counts."""
    started = time.monotonic()
    sources = project_sources(project)
    tests = test_files(project, sources)
    sites = candidate_sites(project, sources, seed=seed, limit=limit)
    stats = ProjectStats(candidates=len(sites))
    rows: list[dict] = []
    source_digest = f"sha256:{project.sha256}"
    message = commit_message(project.homepage.split("github.com/")[-1], project.version)
    async with open_sandbox(project.image_name, cpus=1.0, memory_mb=1024) as sandbox:
        baseline = await run_pytest(sandbox, tests, timeout_s=300)
        passing = {node for node, outcome in baseline.outcomes.items() if outcome == "passed"}
        stats.baseline_tests = len(passing)
        log(f"[{project.name}] baseline: {len(passing)} passing tests, {len(sites)} candidate mutations")
        for number, site in enumerate(sites, 1):
            original = sources[site.path]
            mutated = apply_site(original, site)
            if mutated is None:
                stats.reject("not_applicable")
                continue
            stats.applied += 1
            files = relevant_tests(site.path, tests, sources)
            try:
                await sandbox.write_file(f"{REPO_DIR}/{site.path}", mutated)
                run = await run_pytest(sandbox, files, timeout_s=test_timeout_s)
                diff = await sandbox.exec("git clean -fdq && git diff", timeout=30)
                gold = await sandbox.exec("git diff -R --src-prefix=a/ --dst-prefix=b/", timeout=30)
                commit = await sandbox.exec(
                    "export GIT_INDEX_FILE=/tmp/agentrl_swe/index && rm -f $GIT_INDEX_FILE && git add -A && "
                    f"{COMMIT_ENV} git commit-tree $(git write-tree) -m {json.dumps(message)}", timeout=60)
            except AgentrlError as exc:
                log(f"[{project.name}] {site.site_id}: sandbox error, skipped: {exc}")
                stats.reject("sandbox_error")
                continue
            finally:
                await sandbox.write_file(f"{REPO_DIR}/{site.path}", original)
            relevant = sorted(node for node in passing if node.split("::")[0] in files)
            if run.timed_out:
                stats.reject("timed_out")
                continue
            if any(outcome == "error" for outcome in run.outcomes.values()):
                stats.reject("collection_error")
                continue
            fail_to_pass = [node for node in relevant if run.outcomes.get(node) != "passed"]
            if not fail_to_pass:
                stats.reject("no_failing_test")
                continue
            if diff.exit_code != 0 or gold.exit_code != 0 or commit.exit_code != 0 or not diff.stdout.strip():
                stats.reject("git_error")
                continue
            stats.validated += 1
            fail_set = set(fail_to_pass)
            rows.append({
                "instance_id": f"{project.slug}__{site.function}__{site.site_id}",
                "repo": project.homepage.split("github.com/")[-1],
                "version": project.version,
                "base_commit": commit.stdout.strip(),
                "source_digest": source_digest,
                "patch": gold.stdout,
                "test_patch": "",
                "FAIL_TO_PASS": fail_to_pass,
                "PASS_TO_PASS": [node for node in relevant if node not in fail_set],
                "image_name": project.image_name,
                "problem_statement": problem_statement(project, site, _docstring(original, site.function),
                                                       fail_to_pass, run.output),
                "bug_patch": diff.stdout,
                "test_command": GENERATED_TEST_COMMAND,
                "split": split_of(project, site.path, site.function),
                "license": project.license,
                "mutation": {"operator": site.operator, "file": site.path, "function": site.function,
                             "line": site.line, "site_id": site.site_id, "seed": seed},
            })
            if number % 10 == 0:
                log(f"[{project.name}] {number}/{len(sites)} tried, {stats.validated} validated")
    stats.seconds = round(time.monotonic() - started, 1)
    log(f"[{project.name}] done: {stats.validated}/{stats.candidates} validated in {stats.seconds}s")
    return rows, stats


async def generate(projects: list[Project], *, seed: int, limit: int, parallel: int,
                   out_dir: Path = DATA_DIR, resume: bool = True) -> dict:
    """Generate every project's rows with `parallel` sandboxes at a time and write the split files.

    Each project's rows and counts are saved under `out_dir/projects/` as soon as it is done,
    so an interrupted run resumes where it stopped (with the same seed and limit).
    """
    gate = asyncio.Semaphore(parallel)
    work = out_dir / "projects"
    work.mkdir(parents=True, exist_ok=True)

    async def one(project: Project) -> tuple[list[dict], dict]:
        rows_file, stats_file = work / f"{project.name}.jsonl", work / f"{project.name}.stats.json"
        if resume and rows_file.exists() and stats_file.exists():
            saved = json.loads(stats_file.read_text())
            if saved.get("seed") == seed and saved.get("limit") == limit:
                return [json.loads(line) for line in rows_file.read_text().splitlines() if line], saved["stats"]
        async with gate:
            rows, stats = await generate_project(project, seed=seed, limit=limit)
        rows_file.write_text("".join(json.dumps(row, sort_keys=True) + "\n" for row in rows))
        stats_file.write_text(json.dumps({"seed": seed, "limit": limit, "stats": vars(stats)}, sort_keys=True))
        return rows, vars(stats)

    results = await asyncio.gather(*(one(project) for project in projects))
    rows = sorted((row for project_rows, _ in results for row in project_rows), key=lambda row: row["instance_id"])
    for split in ("train", "test"):
        lines = [json.dumps(row, sort_keys=True) + "\n" for row in rows if row["split"] == split]
        (out_dir / f"{split}.jsonl").write_text("".join(lines))
    stats = {
        "seed": seed, "per_project_candidates": limit,
        "projects": {project.name: stat for project, (_, stat) in zip(projects, results)},
        "validated_tasks": len(rows),
        "splits": {split: sum(1 for row in rows if row["split"] == split) for split in ("train", "test")},
    }
    (out_dir / "stats.json").write_text(json.dumps(stats, indent=2, sort_keys=True) + "\n")
    return stats


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Generate the swe environment's tasks by validated AST mutation.")
    parser.add_argument("projects", nargs="*", help="project names (default: all)")
    parser.add_argument("--seed", type=int, default=0, help="mutation sampling seed")
    parser.add_argument("--per-project", type=int, default=80, help="candidate mutations tried per project")
    parser.add_argument("--parallel", type=int, default=2, help="sandboxes at a time")
    parser.add_argument("--out", type=Path, default=DATA_DIR, help="output folder")
    args = parser.parse_args(argv)
    projects = [get_project(name) for name in args.projects] if args.projects else list(PROJECTS)
    stats = asyncio.run(generate(projects, seed=args.seed, limit=args.per_project, parallel=args.parallel, out_dir=args.out))
    print(json.dumps({k: stats[k] for k in ("validated_tasks", "splits")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
