"""Shared helpers of the swe environment's tests: module path, sample rows, image builds."""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[1]
if str(PACKAGE_DIR) not in sys.path:
    sys.path.insert(0, str(PACKAGE_DIR))

DATA_DIR = PACKAGE_DIR / "data"
# The CI sample: two fast projects (their test suites run in about a second).
SAMPLE_PROJECTS = ("parse", "inflection")


def committed_rows(split: str | None = None) -> list[dict]:
    """The committed task rows (both splits when `split` is None)."""
    rows: list[dict] = []
    for name in ("train", "test") if split is None else (split,):
        rows += [json.loads(line) for line in (DATA_DIR / f"{name}.jsonl").read_text().splitlines() if line]
    return rows


def sample_rows(per_project: int = 1) -> list[dict]:
    """A fixed sample of committed rows from the CI projects (first instance ids of the test split)."""
    rows = sorted(committed_rows("test") + committed_rows("train"), key=lambda row: (row["split"] != "test", row["instance_id"]))
    sample: list[dict] = []
    for project in SAMPLE_PROJECTS:
        sample += [row for row in rows if row["instance_id"].startswith(project + "__")][:per_project]
    return sample


@functools.cache
def build_sample_images() -> tuple[str, ...]:
    """Build (or reuse, by content hash) the base image and the CI projects' images."""
    import docker
    from swe_images import base_image, build_images

    client = docker.from_env()
    try:
        client.images.get(base_image())
    except docker.errors.ImageNotFound:
        from agentrl.sandbox.base_image import build_base_image

        build_base_image()
    return tuple(build_images(list(SAMPLE_PROJECTS)))


# A SWE-bench row on a locally built image: a tiny Django-style project shaped like django__django-11099
# (swebench_django/: Django's test-runner output, a stand-in for the images' conda env `testbed`).
SWEBENCH_FIXTURE = Path(__file__).resolve().parent / "swebench_django"
DJANGO_INSTANCE_ID = "django__django-11099"
DJANGO_NAMESPACE = "agentrl-test"  # never the real `swebench` namespace: the real image must not be shadowed
DJANGO_FAIL_TO_PASS = ["test_ascii_validator (auth_tests.test_validators.UsernameValidatorsTests)",
                       "test_unicode_validator (auth_tests.test_validators.UsernameValidatorsTests)"]
DJANGO_PASS_TO_PASS = ["test_validate (auth_tests.test_validators.MinimumLengthValidatorTest)"]
DJANGO_TEST_FILE = "tests/auth_tests/test_validators.py"


@functools.cache
def build_django_image() -> tuple[str, str]:
    """Build (or reuse, by content hash) the Django-style SWE-bench image; returns (image, base commit)."""
    import docker
    from swe_bench import swebench_image_name
    from swe_images import build_folder_image

    build_sample_images()  # the base image
    image = build_folder_image(SWEBENCH_FIXTURE, tag=swebench_image_name(DJANGO_INSTANCE_ID, namespace=DJANGO_NAMESPACE))
    head = docker.from_env().containers.run(image, "git rev-parse HEAD", remove=True, network_disabled=True)
    return image, head.decode().strip()


def django_eval_script(base_commit: str, test_patch: str) -> str:
    """An eval script as swebench 5's Django rows carry it (same steps and markers)."""
    return "\n".join([
        "#!/bin/bash", "set -uxo pipefail", "source /opt/miniconda3/bin/activate", "conda activate testbed",
        "cd /testbed", "git config --global --add safe.directory /testbed", "cd /testbed", "git status", "git show",
        f"git -c core.fileMode=false diff {base_commit}", "source /opt/miniconda3/bin/activate",
        "conda activate testbed", f"git checkout {base_commit} {DJANGO_TEST_FILE}",
        f"git apply -v - <<'EOF_114329324912'\n{test_patch}EOF_114329324912",
        ": '>>>>> Start Test Output'",
        "./tests/runtests.py --verbosity 2 --settings=test_sqlite --parallel 1 auth_tests.test_validators",
        ": '>>>>> End Test Output'", f"git checkout {base_commit} {DJANGO_TEST_FILE}", ""])


def django_row(*, swebench5: bool = True) -> dict:
    """The SWE-bench row: swebench 5 form (image, eval_script, log_parser, eval_type), or the older form without them."""
    image, base_commit = build_django_image()
    test_patch = (SWEBENCH_FIXTURE / "test.patch").read_text()
    row = {
        "repo": "django/django", "instance_id": DJANGO_INSTANCE_ID, "base_commit": base_commit,
        "patch": (SWEBENCH_FIXTURE / "gold.patch").read_text(), "test_patch": test_patch,
        "problem_statement": "UsernameValidator allows a trailing newline in usernames: ASCIIUsernameValidator and "
                             "UnicodeUsernameValidator use `^...$`, and `$` matches before a trailing newline.",
        "hints_text": "", "created_at": "2019-03-20T03:46:18Z", "version": "3.0",
        "FAIL_TO_PASS": json.dumps(DJANGO_FAIL_TO_PASS), "PASS_TO_PASS": json.dumps(DJANGO_PASS_TO_PASS),
        "environment_setup_commit": base_commit,
    }
    if swebench5:
        row |= {"image": image, "eval_script": django_eval_script(base_commit, test_patch),
                "log_parser": "parse_log_django", "eval_type": "pass_and_fail"}
    return row
