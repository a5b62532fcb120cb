"""environment.toml: every problem reported, most specific first, and bounds on every sandbox limit."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentrl.errors import ConfigError
from agentrl.hub.loader import builtin_environments_dir
from agentrl.hub.manifest import MANIFEST_NAME, SandboxLimits, load_manifest

HEAD = 'name = "toy"\nversion = "0.1.0"\nentrypoint = "toy:load_environment"\n'  # lines 1-3
SANDBOX = '[sandbox]\nimage = "agentrl/toy:0.1.0"\n'  # lines 4-5
LIMITS_LINE = 7  # the first key under [sandbox.limits] (line 6) when written after HEAD + SANDBOX


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / MANIFEST_NAME
    path.write_text(text)
    return path


def _error(path: Path) -> str:
    with pytest.raises(ConfigError) as info:
        load_manifest(path)
    message = str(info.value)
    assert "\n" not in message and "Traceback" not in message and "more error" not in message
    return message


def _limits(tmp_path: Path, body: str) -> Path:
    return _write(tmp_path, HEAD + SANDBOX + "[sandbox.limits]\n" + body)


# --- the three reports seen by users -------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [('"lots"', "memory_mb = 'lots': must be an integer (MiB)"),
     ("-5", "memory_mb = -5: must be at least 16 (MiB)")],
)
def test_bad_memory_limit_is_reported_before_the_missing_image(tmp_path, value, expected):
    path = _write(tmp_path, HEAD + f"\n[sandbox.limits]\nmemory_mb = {value}\n")  # memory_mb on line 6
    message = _error(path)
    assert message == f"{path}:6: sandbox.limits.{expected}; {path}: missing required key 'sandbox.image'"


def test_bad_version_is_reported_before_the_missing_name(tmp_path):
    path = _write(tmp_path, 'version = "1"\nentrypoint = "toy:load_environment"\n')
    message = _error(path)
    assert message == (f"{path}:1: version = '1': must be a semantic version such as 0.1.0; "
                       f"{path}: missing required key 'name'")


def test_negative_memory_limit_is_refused(tmp_path):
    path = _limits(tmp_path, "cpus = 2.0\nmemory_mb = -5\n")
    assert _error(path) == f"{path}:8: sandbox.limits.memory_mb = -5: must be at least 16 (MiB)"


def test_every_problem_is_listed_most_specific_first(tmp_path):
    path = _write(tmp_path, (
        'name = "Bad Name"\n'  # 1
        'entrypoint = "toy"\n'  # 2
        'colour = "blue"\n'  # 3
        'tags = ["ok", 7]\n'  # 4
        '[sandbox]\n'  # 5
        'imgae = "agentrl/toy:0.1.0"\n'  # 6
        '[sandbox.limits]\n'  # 7
        'memory_mb = -5\n'  # 8
        'pids = 100000\n'  # 9
    ))
    assert _error(path).split("; ") == [
        f"{path}:8: sandbox.limits.memory_mb = -5: must be at least 16 (MiB)",
        f"{path}:9: sandbox.limits.pids = 100000: must be at most 65536 (processes)",
        f"{path}:4: tags[1] = 7: must be a string",
        f"{path}:1: name = 'Bad Name': must be lowercase letters, digits, '-' or '_' (at most 64)",
        f"{path}:2: entrypoint = 'toy': must look like 'module:function'",
        f"{path}:6: unknown key 'sandbox.imgae' (did you mean 'sandbox.image'?)",
        f"{path}:3: unknown key 'colour'",
        f"{path}:5: missing required key 'sandbox.image'",
    ]


def test_a_value_refused_by_every_member_of_a_union_is_one_problem(tmp_path):
    path = _write(tmp_path, HEAD + "[env_args]\nsizes = [1, 2]\n")
    assert _error(path) == (f"{path}:5: env_args.sizes = [1, 2]: must be a string, an integer, a number "
                            "or a boolean (true or false)")


# --- bounds on every limit ----------------------------------------------------------------------

# (field, refused value, what the message says it must be): one past each end
REFUSED = [
    ("cpus", "0", "0", "must be greater than 0 (CPU cores)"),
    ("cpus", "-1.5", "-1.5", "must be greater than 0 (CPU cores)"),
    ("cpus", "256.5", "256.5", "must be at most 256 (CPU cores)"),
    ("memory_mb", "15", "15", "must be at least 16 (MiB)"),
    ("memory_mb", "1048577", "1048577", "must be at most 1048576 (MiB)"),
    ("pids", "7", "7", "must be at least 8 (processes)"),
    ("pids", "65537", "65537", "must be at most 65536 (processes)"),
    ("disk_mb", "0", "0", "must be at least 1 (MiB)"),
    ("disk_mb", "10485761", "10485761", "must be at most 10485760 (MiB)"),
    ("timeout_s", "0.0", "0.0", "must be greater than 0 (seconds)"),
    ("timeout_s", "86401", "86401", "must be at most 86400 (seconds)"),
    ("timeout_s", "nan", "nan", "must be at most 86400 (seconds)"),
    ("output_bytes", "1023", "1023", "must be at least 1024 (bytes)"),
    ("output_bytes", "1073741825", "1073741825", "must be at most 1073741824 (bytes)"),
    ("memory_mb", "1.5", "1.5", "must be an integer (MiB)"),
    ("cpus", '"two"', "'two'", "must be a number (CPU cores)"),
]

# (field, accepted value at an end of its range)
ACCEPTED = [
    ("cpus", 0.001), ("cpus", 256.0), ("memory_mb", 16), ("memory_mb", 1_048_576),
    ("pids", 8), ("pids", 65_536),
    ("disk_mb", 1), ("disk_mb", 10_485_760), ("timeout_s", 0.001), ("timeout_s", 86_400.0),
    ("output_bytes", 1024), ("output_bytes", 1_073_741_824),
]


@pytest.mark.parametrize(("field", "toml_value", "shown", "expected"), REFUSED)
def test_limit_outside_its_range_is_refused_naming_field_line_value_and_unit(
    tmp_path, field, toml_value, shown, expected
):
    path = _limits(tmp_path, f"{field} = {toml_value}\n")
    assert _error(path) == f"{path}:{LIMITS_LINE}: sandbox.limits.{field} = {shown}: {expected}"


@pytest.mark.parametrize(("field", "value"), ACCEPTED)
def test_limit_at_the_end_of_its_range_loads(tmp_path, field, value):
    manifest = load_manifest(_limits(tmp_path, f"{field} = {value!r}\n"))
    assert getattr(manifest.sandbox.limits, field) == value


def test_every_limit_has_both_bounds_tested():
    fields = set(SandboxLimits.model_fields)
    assert {f for f, *_ in REFUSED} == fields and {f for f, _ in ACCEPTED} == fields
    for field in fields:
        assert len([v for f, v in ACCEPTED if f == field]) == 2, field


# --- valid manifests still load -----------------------------------------------------------------


def test_valid_manifest_loads(tmp_path):
    path = _write(tmp_path, HEAD + 'tags = ["single-turn"]\n[dataset]\ngenerator = "toy:build"\n' + SANDBOX
                  + "[sandbox.limits]\ncpus = 2.5\nmemory_mb = 4096\npids = 512\ndisk_mb = 8192\n"
                  + "timeout_s = 120\noutput_bytes = 65536\n")
    manifest = load_manifest(tmp_path)  # the folder works as well as the file
    assert manifest.name == "toy" and manifest.version == "0.1.0" and manifest.tags == ["single-turn"]
    assert manifest.sandbox is not None and manifest.sandbox.image == "agentrl/toy:0.1.0"
    expected = {"cpus": 2.5, "memory_mb": 4096, "pids": 512, "disk_mb": 8192, "timeout_s": 120.0,
                "output_bytes": 65536}
    assert manifest.sandbox.limits.model_dump() == expected
    assert load_manifest(path) == manifest


def test_defaults_are_within_the_bounds(tmp_path):
    manifest = load_manifest(_write(tmp_path, HEAD + SANDBOX))
    assert manifest.sandbox is not None and manifest.sandbox.limits == SandboxLimits()
    assert load_manifest(_write(tmp_path, HEAD)).sandbox is None


@pytest.mark.parametrize("name", ["arithmetic", "reverse_text", "swe"])
def test_builtin_manifests_still_load(name):
    assert load_manifest(builtin_environments_dir() / name).name.replace("-", "_") == name
