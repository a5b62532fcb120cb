"""swe task generation: deterministic mutation enumeration, reproducible rows, split hygiene, input errors.

No Docker needed: mutations are enumerated and applied on the host from the pinned sdists
(downloaded from PyPI on first use, sha256-checked), and the committed rows' bug patches
are reproduced byte for byte with git on the host.
"""

from __future__ import annotations

import sys
from pathlib import Path

for _folder in (Path(__file__).resolve().parent, Path(__file__).resolve().parents[1]):
    if str(_folder) not in sys.path:  # the package's modules and the shared test helpers
        sys.path.insert(0, str(_folder))

import ast
import json
import subprocess
from collections import Counter

import pytest
from swe_generate import candidate_sites, project_sources, split_of
from swe_mutate import OPERATORS, apply_site, enumerate_sites, select_sites
from swe_projects import PROJECTS, get_project
from swe_task import SweInstance, load_instances
from swe_testlib import DATA_DIR, committed_rows

from agentrl.errors import AgentrlError, ConfigError, NotFoundError

SOURCE = '''
def clamp(value, low=0, high=10):
    """Clamp value into [low, high]."""
    if value < low:
        return low
    if value > high:
        return high
    return max(low, min(value, high)) + 0


class Box:
    def area(self, width, height):
        return width * height if width >= 0 and height >= 0 else None
'''


def test_enumeration_is_deterministic_and_covers_operators():
    sites = enumerate_sites(SOURCE, "m.py")
    assert sites == enumerate_sites(SOURCE, "m.py")
    found = Counter(site.operator for site in sites)
    for operator in ("flip_comparison", "off_by_one", "swap_arguments", "drop_branch", "swap_operator"):
        assert found[operator] >= 1, operator
    assert {site.function for site in sites} == {"clamp", "Box.area"}
    assert set(found) <= set(OPERATORS)


def test_applied_mutations_parse_change_one_spot_and_keep_the_rest():
    for site in enumerate_sites(SOURCE, "m.py"):
        mutated = apply_site(SOURCE, site)
        assert mutated is not None and mutated != SOURCE
        ast.parse(mutated)
        changed = [i for i, (a, b) in enumerate(zip(SOURCE.splitlines(), mutated.splitlines())) if a != b]
        if site.operator != "drop_branch":
            assert len(changed) == 1 and SOURCE.count("\n") == mutated.count("\n")
            assert '"""Clamp value into [low, high]."""' in mutated


def test_nested_sites_starting_at_one_place_get_their_own_ids_and_nodes():
    source = "def total(a, b, c):\n    return a + b + c\n"
    outer, inner = [s for s in enumerate_sites(source, "m.py") if s.operator == "swap_operator"]
    assert outer.site_id != inner.site_id and (outer.line, outer.col) == (inner.line, inner.col)
    assert apply_site(source, outer).splitlines()[1] == "    return a + b - c"
    assert apply_site(source, inner).splitlines()[1] == "    return a - b + c"


def test_site_ids_are_unique_in_every_project():
    for project in PROJECTS:
        sources = project_sources(project)
        ids = [site.site_id for path in sources if path in project.packages or any(
            path.startswith(root + "/") for root in project.packages) for site in enumerate_sites(sources[path], path)]
        assert ids and len(ids) == len(set(ids)), project.name


def test_flip_and_swap_edit_only_the_operator_or_arguments():
    sites = enumerate_sites(SOURCE, "m.py")
    flip = next(s for s in sites if s.operator == "flip_comparison" and s.line == 4)
    assert "    if value >= low:\n" in apply_site(SOURCE, flip)
    swap = next(s for s in sites if s.operator == "swap_arguments" and s.function == "clamp")
    assert "max(min(value, high), low)" in apply_site(SOURCE, swap)


def test_selection_depends_on_the_seed_only():
    sites = enumerate_sites(SOURCE, "m.py")
    assert select_sites(sites, seed=3, max_per_function=2) == select_sites(list(reversed(sites)), seed=3, max_per_function=2)
    picks = {tuple(s.site_id for s in select_sites(sites, seed=seed, max_per_function=50)) for seed in range(5)}
    assert len(picks) > 1
    per_function = Counter(s.function for s in select_sites(sites, seed=0, max_per_function=2))
    assert max(per_function.values()) <= 2


def test_project_candidates_are_deterministic_for_a_seed():
    project = get_project("parse")
    sources = project_sources(project)
    first = candidate_sites(project, sources, seed=0, limit=70)
    assert first == candidate_sites(project, sources, seed=0, limit=70)
    assert first != candidate_sites(project, sources, seed=1, limit=70)
    assert 0 < len(first) <= 70
    assert max(Counter((s.path, s.function) for s in first).values()) <= 3


def _git_diff(tmp_path, path: str, original: str, mutated: str) -> str:
    repo = tmp_path / "repo"
    target = repo / path
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(original)
    def run(*args):
        return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True).stdout

    run("init", "-q")
    run("add", "-A")
    target.write_text(mutated)
    return run("-c", "core.quotepath=off", "diff")


@pytest.mark.parametrize("project_name", ["parse", "inflection"])
def test_committed_rows_are_reproduced_from_their_seed(project_name, tmp_path):
    project = get_project(project_name)
    rows = [row for row in committed_rows() if row["instance_id"].startswith(project.slug + "__")]
    assert rows, f"no committed rows for {project_name}"
    sources = project_sources(project)
    seed = rows[0]["mutation"]["seed"]
    limit = json.loads((DATA_DIR / "stats.json").read_text())["per_project_candidates"]
    candidates = {site.site_id: site for site in candidate_sites(project, sources, seed=seed, limit=limit)}
    for index, row in enumerate(rows[:5]):
        site = candidates[row["mutation"]["site_id"]]
        mutated = apply_site(sources[site.path], site)
        assert _git_diff(tmp_path / str(index), site.path, sources[site.path], mutated) == row["bug_patch"]


def test_committed_data_meets_the_targets_and_splits_share_no_function():
    rows = committed_rows()
    assert len(rows) >= 200
    assert len({row["repo"] for row in rows}) >= 5
    ids = [row["instance_id"] for row in rows]
    assert len(ids) == len(set(ids))
    functions = {split: {(row["repo"], row["mutation"]["file"], row["mutation"]["function"])
                         for row in rows if row["split"] == split} for split in ("train", "test")}
    assert functions["train"] and functions["test"]
    assert not functions["train"] & functions["test"]
    for row in rows:
        instance = SweInstance.from_row(row)
        assert instance.FAIL_TO_PASS and not set(instance.FAIL_TO_PASS) & set(instance.PASS_TO_PASS)
        assert row["split"] == split_of(get_project(row["instance_id"].split("__")[0]), row["mutation"]["file"],
                                        row["mutation"]["function"])
        # the statement describes the failure, never the fix
        assert row["patch"] not in row["problem_statement"]
        removed = [line[1:].strip() for line in row["bug_patch"].splitlines()
                   if line.startswith("-") and not line.startswith("---") and len(line[1:].strip()) > 12]
        assert not any(text in row["problem_statement"] for text in removed), row["instance_id"]


def test_every_project_has_a_licence_and_pinned_digest():
    for project in PROJECTS:
        assert project.license in ("MIT", "BSD-3-Clause") and len(project.sha256) == 64


def test_bad_input_gives_one_line_errors(tmp_path):
    with pytest.raises(NotFoundError, match="unknown project 'nope'; known projects: inflection"):
        get_project("nope")
    bad = tmp_path / "rows.jsonl"
    bad.write_text('{"instance_id": "x", "repo": "a/b"}\n')
    with pytest.raises(ConfigError, match=r"rows.jsonl:1: field 'base_commit'"):
        load_instances(bad)
    bad.write_text("{not json\n")
    with pytest.raises(ConfigError, match=r"rows.jsonl:1: not valid JSON"):
        load_instances(bad)
    with pytest.raises(AgentrlError, match="does not exist"):
        load_instances(tmp_path / "missing.jsonl")


def test_swe_bench_rows_load_with_json_encoded_test_lists():
    row = {
        "instance_id": "astropy__astropy-12907", "repo": "astropy/astropy", "base_commit": "d16bfe05a744909de4b27f5875fe0d4ed41ce607",
        "patch": "diff --git a/x b/x\n", "test_patch": "", "problem_statement": "bug",
        "FAIL_TO_PASS": '["astropy/modeling/tests/test_separable.py::test_separable[compound_model6-result6]"]',
        "PASS_TO_PASS": "[]", "version": "4.3",
    }
    instance = SweInstance.from_row(row)
    assert instance.FAIL_TO_PASS == ["astropy/modeling/tests/test_separable.py::test_separable[compound_model6-result6]"]
    assert instance.image_name == "swebench/sweb.eval.x86_64.astropy_1776_astropy-12907:latest"
    assert instance.test_files == ["astropy/modeling/tests/test_separable.py"]


def test_oracle_turns_each_hunk_into_a_str_replace_edit():
    from swe_oracle import patch_edits

    patch = (
        "diff --git a/pkg/m.py b/pkg/m.py\nindex 1..2 100644\n--- a/pkg/m.py\n+++ b/pkg/m.py\n"
        "@@ -1,3 +1,3 @@\n def f(x):\n-    return x >= 0\n+    return x < 0\n \n"
        "@@ -10,2 +10,3 @@ def g():\n     a = 1\n+    b = 2\n     return a\n"
    )
    assert patch_edits(patch) == [
        ("pkg/m.py", "def f(x):\n    return x >= 0\n\n", "def f(x):\n    return x < 0\n\n"),
        ("pkg/m.py", "    a = 1\n    return a\n", "    a = 1\n    b = 2\n    return a\n"),
    ]


def test_compact_mode_fits_small_context_models():
    import agentrl

    full = agentrl.load_environment("swe")
    compact = agentrl.load_environment("swe", compact=True)
    assert [t["function"]["name"] for t in compact.tool_schemas] == ["bash", "submit"]
    assert len(json.dumps(compact.tool_schemas)) < len(json.dumps(full.tool_schemas)) / 2
    task = compact.tasks("test", n=1)[0]
    assert len(task.prompt[-1].content) <= 210 and compact.max_turns == 3


@pytest.mark.integration
async def test_generation_in_a_sandbox_reproduces_the_committed_rows():
    from swe_generate import generate_project
    from swe_testlib import build_sample_images

    build_sample_images()
    project = get_project("parse")
    committed = {row["instance_id"]: row for row in committed_rows()}
    rows, stats = await generate_project(project, seed=0, limit=3, log=lambda message: None)
    assert stats.candidates == 3 and stats.validated == len(rows) >= 1
    for row in rows:
        assert json.loads(json.dumps(row, sort_keys=True)) == committed[row["instance_id"]]
