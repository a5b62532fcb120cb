"""Bad values and unusable outputs on the command line: one line naming the field or file, exit 2, no traceback,
before any start-up; and nothing already written lost.

On main: `agentrl eval -o FILE`, `-o FILE/sub`, a read-only output folder, a full disk, a config that is not
UTF-8 and `sandbox run --timeout 1e30` ended in tracebacks; `--max-tokens -1`, `--temperature -1`, `top_p=2`
and `sandbox run --timeout -1` were accepted; `--temperature nan` failed every rollout instead of the config.
"""

from __future__ import annotations

import os
import socket
import subprocess

import pytest

from tests.unit.test_eval_failures import refusing_server  # noqa: F401  (a fixture)


def _closed_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def _eval(capsys, *args: str) -> tuple[int, str]:
    from agentrl.cli import main

    code = main(["eval", "--base-url", _closed_url(), "--model", "served", "-n", "1", *args])
    return code, capsys.readouterr().err.strip()


@pytest.mark.parametrize(("args", "said"), [
    (["--temperature", "nan"], "--temperature: sampling.temperature = nan: must be a finite number"),
    (["--temperature", "-1"], "--temperature: sampling.temperature = -1.0: must be at least 0"),
    (["--max-tokens", "-1"], "--max-tokens: sampling.max_tokens = -1: must be at least 1"),
    # the flag, not `<defaults>: n = 0` (a newcomer's walk-through: the key `n` is nowhere on the command line)
    (["-n", "0"], "error: -n/--num-tasks: n = 0: must be at least 1"),
    (["-r", "0"], "error: -r/--rollouts-per-task: rollouts_per_task = 0: must be at least 1"),
    (["--set", "sampling.top_p=2"], "sampling.top_p = 2: must be at most 1"),
    (["--set", "sampling.top_k=-5"], "sampling.top_k = -5: must be at least -1"),
])
def test_sampling_values_are_range_checked_at_the_config(capsys, tmp_path, args, said):
    code, err = _eval(capsys, "-o", str(tmp_path / "out"), *args)
    assert code == 2 and said in err and "\n" not in err and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()


def test_outputs_that_cannot_be_a_folder_are_one_line(capsys, tmp_path):
    afile = tmp_path / "results.txt"
    afile.write_text("kept\n")
    for output in (afile, afile / "sub"):
        code, err = _eval(capsys, "-o", str(output))
        assert code == 2 and f"{afile} is a file, not a folder; give a folder with -o" in err and "\n" not in err
    assert afile.read_text() == "kept\n"


def test_a_config_that_is_not_utf8_is_one_line(capsys, tmp_path):
    config = tmp_path / "eval.toml"
    config.write_bytes(b'model = "\xff"\n')
    code, err = _eval(capsys, "-c", str(config))
    assert code == 2 and err == f"error: {config}: not UTF-8 text (byte 9); save it as UTF-8"


@pytest.fixture
def tiny_tmpfs(tmp_path):
    """A 64 KiB tmpfs (root only), unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mount = tmp_path / "mnt"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "agentrl-test", str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "--lazy", str(mount)], check=False)


def test_a_read_only_output_folder_is_one_line(capsys, tiny_tmpfs):
    subprocess.run(["mount", "-o", "remount,ro", str(tiny_tmpfs)], check=True)
    code, err = _eval(capsys, "-o", str(tiny_tmpfs / "eval"))
    assert code == 2 and f"output {tiny_tmpfs / 'eval'}: {tiny_tmpfs} is not writable" in err and "\n" not in err


def test_a_full_disk_stops_in_one_line_and_keeps_what_was_written(capsys, tiny_tmpfs, refusing_server):  # noqa: F811
    from agentrl.cli import main

    filler = tiny_tmpfs / "filler"
    with open(filler, "wb", buffering=0) as handle:
        try:
            while True:
                handle.write(b"x" * 4096)
        except OSError:  # full
            pass
    size = filler.stat().st_size
    output = tiny_tmpfs / "eval"
    code = main(["eval", "--base-url", refusing_server, "--model", "served", "--client", "openai", "-n", "2",
                 "-o", str(output)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "results.jsonl: cannot write results (No space left on device)" in err, err
    assert "\n" not in err and filler.stat().st_size == size


@pytest.mark.parametrize(("timeout", "said"), [
    ("1e30", "exec_timeout_s = 1e+30: must be at most 604800"),
    ("-1", "exec_timeout_s = -1.0: must be greater than 0"),
    ("nan", "exec_timeout_s = nan"),
])
def test_sandbox_run_timeouts_are_range_checked(capsys, timeout, said):
    from agentrl.cli import main

    assert main(["sandbox", "run", "--timeout", timeout, "--", "true"]) == 2
    err = capsys.readouterr().err.strip()
    assert said in err and "\n" not in err and "Traceback" not in err, err


def test_more_tasks_than_the_split_has_is_said_in_one_line(capsys, tmp_path):
    """`-n 2` on a one-task package ran one task and said nothing (an ecosystem walk-through)."""
    code, err = _eval(capsys, "--env", "reverse-text", "-n", "100000", "-o", str(tmp_path / "out"))
    assert code == 2 and "error: base_url" in err  # the closed URL stops it after the draw
    assert "warning: n = 100000 tasks asked, but split 'test' of 'reverse-text' has 200: evaluating 200\n" in err
    code, err = _eval(capsys, "--env", "reverse-text", "-o", str(tmp_path / "out"))  # -n 1: no warning
    assert "warning" not in err
