"""The Harbor verifier as Harbor runs it, and the rewards as Harbor reads them.

`run_verifier` runs in the fresh sandbox `grade_in_fresh_sandbox` gives (the agent's working
directory, the verifier phase's user, env and network): `tests/` (then the step's own) uploaded
to `/tests`, `/tests/test.sh` run with `[verifier] env` and its timeout, then
`/logs/verifier/reward.json` read before `reward.txt` (`parse_rewards`), as Harbor reads them, but
from channels the tests' processes cannot rewrite later: the files are printed the moment
test.sh exits, every process left is killed, and a file that changed in between scores 0
(`tamper_suspected`); reward.json counts only where the task's tests write it (or
reward.txt agrees). The code under test runs as the same user as test.sh, so it can also get in
test.sh's way while test.sh runs; scored 0 as tampering too: a file of `/tests` changed or removed
(bash reads test.sh as it runs it: an appended line runs), and a reward file or `/logs/verifier`
left as something test.sh may not have written (a symbolic link, not a regular file or folder, or
not writable: a `1` made read-only before test.sh writes its `0`). Tests that import or run the
agent's code give it their exit status (as in Harbor itself); a module installed in the image (the standard
library, site-packages) no longer comes from the agent's working directory where Python runs from it
(`python3 -m unittest`, `-m pytest`, `-c`): every Python of test.sh starts with `verifier_site`'s rules
(`_python_site`). What would run
the agent's files in tests that only read its output is turned off: a carried repo's git fsmonitor and
hooks (`_NO_AGENT_CODE_ENV`), and a carried user site-packages' start-up hooks, removed on the host
before the files go in (`drop_user_site_hooks`). After test.sh the wrapper reads the reward files,
test.sh and /proc with shell builtins only: on a writable root the code under test can replace the
image's programs (a `/bin/cat` that says 1); only the second checksums of /tests
come from a program (`cksum`). `combine_rewards` makes
the one reward (the `primary` key, else `reward`, else the only key, else the mean);
`settle_rewards` combines a multi-step trial's steps (Harbor's per-key mean, or the final step's);
`below_min_reward` is Harbor's `min_reward` gate.
"""

from __future__ import annotations

import json
import math
import os
import re
import secrets
import shlex
import shutil
from collections.abc import Collection
from pathlib import Path
from typing import Any

from agentrl.errors import ProcessesSurvived
from agentrl.hub.interop.harbor_config import HarborStep, HarborTask, resolve_env
from agentrl.hub.interop.verifier_site import SITE_DIR

__all__ = ["REWARD_DIR", "parse_rewards", "combine_rewards", "run_verifier", "settle_rewards",
           "below_min_reward", "verifier_reward", "verifier_ran", "allow_apt_as_root"]

REWARD_DIR = "/logs/verifier"
_REWARD_FILES = ("reward.json", "reward.txt")
# Root commands in agentrl's sandboxes hold no capabilities, so apt cannot drop to its `_apt` user
# (setgroups): where the root is writable, apt is told to stay root, and `apt-get install` works as in Harbor.
_APT_AS_ROOT = ("[ -d /etc/apt/apt.conf.d ] && [ \"$(id -u)\" = 0 ] && "
                "echo 'APT::Sandbox::User \"root\";' > /etc/apt/apt.conf.d/00agentrl-sandbox; true")


async def allow_apt_as_root(sandbox) -> None:
    """On a writable root, let apt run as root (it cannot setgroups to `_apt` without capabilities)."""
    if sandbox.config.disk_limit == "none":
        await sandbox.exec(["/bin/sh", "-c", _APT_AS_ROOT], timeout=30)


def parse_rewards(text: str, name: str) -> dict[str, float]:
    """The rewards of reward.json (a number or named numbers) or reward.txt (a number); else ValueError."""
    if not text.strip():
        raise ValueError("the file is empty")
    if name.endswith(".json"):
        data = json.loads(text)
        rewards = data if isinstance(data, dict) else {"reward": data}
    else:
        rewards = {"reward": float(text.strip())}
    for key, value in rewards.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{key} = {value!r} is not a finite number")
    return {str(key): float(value) for key, value in rewards.items()}


def combine_rewards(rewards: dict[str, float], primary: str | None) -> float:
    """The one reward: the `primary` key, else 'reward', else the only key, else the mean of all."""
    if not rewards:
        return 0.0
    for key in (primary, "reward"):
        if key and key in rewards:
            return rewards[key]
    return sum(rewards.values()) / len(rewards)


def verifier_reward(state: dict[str, Any]) -> float:
    """The reward the task's verifier wrote (0.0 when it wrote none)."""
    return float(state.get("verifier_reward") or 0.0)


def verifier_ran(state: dict[str, Any]) -> float:
    """1.0 when the tests ran for every step verified and each produced a readable, untampered reward (a metric)."""
    ran = state.get("tests_ran") or []
    return 1.0 if ran and all(ran) and not state.get("verifier_error") else 0.0


def _rewards_snapshot(stdout: str, marker: str) -> tuple[dict[str, str], tuple[int, int, int]] | None:
    """The reward files as the wrapper printed them right after test.sh exited, and its counts (processes the tests
    left running, files of /tests changed or removed, reward paths test.sh may not have written); None when stdout
    holds anything else (only the wrapper writes there: test.sh's goes to stderr)."""
    body = stdout.removeprefix("\n")
    tail = body.rstrip("\n").rsplit("\n", 1)[-1]
    counts = tail.removeprefix(marker + ":end ").split(" ")
    if not body.startswith(marker + "\n") or not tail.startswith(marker + ":end ") or len(counts) != 3 \
            or not all(count.isdigit() for count in counts):
        return None
    body = body[len(marker) + 1:body.rstrip("\n").rindex("\n") + 1] if "\n" in body.rstrip("\n") else ""
    body = body.removeprefix(marker + "\n")
    files: dict[str, str] = {}
    while body:
        heads = [name for name in _REWARD_FILES if body.startswith(f"{marker}:file {name}\n") and name not in files]
        if not heads:
            return None
        content, found, body = body[len(f"{marker}:file {heads[0]}\n"):].partition(f"\n{marker}:eof\n")
        if not found or marker in content:
            return None
        files[heads[0]] = content
    survivors, changed, suspicious = (int(count) for count in counts)
    return files, (survivors, changed, suspicious)


# After test.sh exits the wrapper reads files and /proc with shell builtins: on a writable root the code under test
# (same user as test.sh) can have replaced any program of the image (`cat`, `sed`, `ls`...). `_status DIR` reads a
# process's State, PPid and Threads from DIR/status into $S, $P and $H.
_STATUS = ('_status() { S=; P=; H=; while IFS=": \t" read -r k v; do case "$k" in State) S=${v%% *};; '
           'PPid) P=$v;; Threads) H=$v;; esac; done < "$1/status"; } 2>/dev/null; ')
# Counts the processes still alive besides this shell, its ancestors (the command server, init) and its own
# children: what the tests left running when test.sh exited (zombies do not count: they cannot write; but a zombie
# leader whose other threads run, its leader ended alone with SYS_exit, does).
_SURVIVORS = (
    'self=$$; chain=" $$ "; p=$$; while [ "$p" -gt 1 ] 2>/dev/null; do _status /proc/$p; p=$P; '
    '[ -n "$p" ] || break; chain="$chain$p "; done; '
    'n=0; for d in /proc/[0-9]*; do q=${d#/proc/}; case "$chain" in *" $q "*) continue;; esac; _status "$d"; '
    'case "$S:$P:$H" in :*|Z*:1|Z*:|*":$self:"*) continue;; esac; n=$((n+1)); done; '
)
# test.sh's text, read before it runs (`script`) and again after (`_text` into $T), by the shell alone (bash reads a
# script as it runs it: a line the code under test appends to test.sh runs); and the checksums of every file of /tests
# before and after (`changed`: how many of those taken before are not among those after, i.e. rewritten or
# removed; files added are not counted, tests may write caches). `cksum` after test.sh is a program of the image,
# so on a writable root this second count is only as good as that program.
_READ_SCRIPT = ("nl=$(printf '\\nx'); nl=${nl%x}; "
                '_text() { T=; while IFS= read -r l || [ -n "$l" ]; do T="$T$l$nl"; done < "$1"; } 2>/dev/null; '
                '_text /tests/test.sh; script=$T; ')
_TESTS_SUMS = "find /tests -type f -exec cksum {} + 2>/dev/null | sort"
_TESTS_CHANGED = (
    '_text /tests/test.sh; changed=0; [ "$T" = "$script" ] || changed=1; '
    'while IFS= read -r line; do [ -n "$line" ] || continue; case "$nl$after$nl" in *"$nl$line$nl"*) ;; '
    '*) changed=$((changed+1));; esac; done <<SUMS_BEFORE\n$before\nSUMS_BEFORE\n'
)
# How many of /logs/verifier and its reward files are in a state test.sh may not have left them in: a symbolic
# link, not a folder or regular file, or not writable (a `1` the code under test wrote and made read-only, so that
# test.sh's own write failed; root without capabilities is refused like any owner).
_SUSPICIOUS = (
    f'suspicious=0; if [ -L {REWARD_DIR} ] || [ ! -d {REWARD_DIR} ] || [ ! -w {REWARD_DIR} ]; then '
    "suspicious=1; fi; "
    + "".join(f'if [ -e {REWARD_DIR}/{name} ] || [ -L {REWARD_DIR}/{name} ]; then '
              f'if [ -L {REWARD_DIR}/{name} ] || [ ! -f {REWARD_DIR}/{name} ] || [ ! -w {REWARD_DIR}/{name} ]; then '
              "suspicious=$((suspicious+1)); fi; fi; " for name in _REWARD_FILES)
)


# Every Python of test.sh starts with agentrl's `sitecustomize` (`verifier_site`): modules installed in the image come
# before the agent's files in the working directory. The image's PYTHONPATH entries in the working directory (its
# `ENV PYTHONPATH=/app`; an empty or relative entry, i.e. the folder a Python runs from) would come before the
# standard library while the interpreter starts (it imports `encodings` before any sitecustomize): they move to
# AGENTRL_VERIFIER_PYTHONPATH, which the sitecustomize puts back on sys.path behind its own rules.
def _python_site(workdir: str) -> str:
    root = shlex.quote(workdir.rstrip("/") or "/")
    # each entry compared resolved (`pwd -P`: through links, `//app`), else as written (a zip file)
    return (f'w=$(cd -- {root} 2>/dev/null && pwd -P) || w={root}; '
            'kept=; moved=; if [ -n "${PYTHONPATH+x}" ]; then saved_ifs=$IFS; IFS=:; set -f; for e in $PYTHONPATH; '
            'do r=$(cd -- "$e" 2>/dev/null && pwd -P) || r=$e; '
            'case "$r" in "$w"|"${w%/}"/*|""|[!/]*) moved="$moved${moved:+:}${e:-.}";; '
            '*) kept="$kept${kept:+:}$e";; esac; done; set +f; IFS=$saved_ifs; '
            'case "$PYTHONPATH" in ?*:) moved="$moved${moved:+:}.";; esac; fi; '  # a trailing empty entry too
            f'export PYTHONPATH="{SITE_DIR}${{kept:+:$kept}}" AGENTRL_VERIFIER_PYTHONPATH="$moved"; ')


def _wrapper(marker: str, *, workdir: str) -> str:
    """Runs test.sh (its output to stderr), then prints every reward file and its counts (processes the tests left
    running, files of /tests changed, reward paths in a state test.sh may not have left) to stdout."""
    blocks = "".join(f'if [ -f {REWARD_DIR}/{name} ]; then printf "%s\\n" "{marker}:file {name}"; '
                     f'l=; while IFS= read -r l; do printf "%s\\n" "$l"; done < {REWARD_DIR}/{name}; printf "%s" "$l"; '
                     f'printf "\\n%s\\n" "{marker}:eof"; fi; ' for name in _REWARD_FILES)
    return (f'{_STATUS}{_READ_SCRIPT}before=$({_TESTS_SUMS}); {_python_site(workdir)}'
            f'/tests/test.sh 1>&2; rc=$?; {_SUSPICIOUS}'
            f'printf "\\n%s\\n" "{marker}"; {blocks}{_SURVIVORS}after=$({_TESTS_SUMS}); {_TESTS_CHANGED}'
            f'printf "%s %s %s %s\\n" "{marker}:end" "$n" "$changed" "$suspicious"; exit $rc')


def task_writes_reward_json(harbor: HarborTask, step: HarborStep) -> bool:
    """Whether the task's own tests (its tests/ and the step's) mention reward.json, i.e. may write it."""
    for folder in (Path(harbor.folder) / "tests", Path(harbor.folder) / step.folder / "tests"):
        if folder.is_dir():
            for path in folder.rglob("*"):
                if path.is_file() and not path.is_symlink() and b"reward.json" in path.read_bytes():
                    return True
    return False


def _accepted_rewards(files: dict[str, str], *, json_allowed: bool) -> tuple[dict[str, float] | None, str, bool]:
    """(rewards, error, tampering suspected) from the snapshot of the reward files."""
    if "reward.json" in files:
        try:
            rewards = parse_rewards(files["reward.json"], "reward.json")
        except ValueError as problem:
            return None, f"{REWARD_DIR}/reward.json: {problem}", False
        if json_allowed:
            return rewards, "", False
        try:
            agree = "reward.txt" in files and \
                parse_rewards(files["reward.txt"], "reward.txt")["reward"] == combine_rewards(rewards, None)
        except ValueError:
            agree = False
        if agree:
            return rewards, "", False
        return None, (f"{REWARD_DIR}/reward.json was written, but the task's tests never write it "
                      "(and reward.txt does not agree with it)"), True
    if "reward.txt" in files:
        try:
            return parse_rewards(files["reward.txt"], "reward.txt"), "", False
        except ValueError as problem:
            return None, f"{REWARD_DIR}/reward.txt: {problem}", False
    return None, "", False


_NO_AGENT_CODE_ENV = {
    "GIT_CONFIG_COUNT": "2", "GIT_CONFIG_KEY_0": "core.fsmonitor", "GIT_CONFIG_VALUE_0": "false",
    "GIT_CONFIG_KEY_1": "core.hooksPath", "GIT_CONFIG_VALUE_1": "/dev/null",
}
"""test.sh's environment, under the task's own: git runs no fsmonitor or hook of a carried repo (see
`run_verifier`)."""
_USER_SITE = re.compile(r"/\.local/lib/python[^/]*/site-packages$")
_STARTUP_MODULES = ("usercustomize", "sitecustomize")


def drop_user_site_hooks(local: Path, remote: str) -> list[str]:
    """Remove from a carried folder (`local` on the host, `remote` in the sandbox) what a user site-packages
    (`~/.local/lib/python*/site-packages`) runs at every Python start: `usercustomize` and `sitecustomize` in any
    form (module, package, compiled) and `.pth` files; the remote paths removed. A carried HOME kept them: paid 1.0
    for a wrong fix (red team, 2026-12-07). The site-packages' packages stay (the image's `pip install --user`)."""
    removed = []
    for root, folders, files in os.walk(local):
        relative = Path(root).relative_to(local).as_posix()
        folder = remote.rstrip("/") + ("" if relative == "." else "/" + relative)
        if not _USER_SITE.search(folder):
            continue
        for name in sorted(files + folders):
            if name.endswith(".pth") or name.split(".", 1)[0] in _STARTUP_MODULES:
                path = Path(root) / name
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path)
                    folders.remove(name)
                else:
                    path.unlink()
                removed.append(f"{folder}/{name}")
    return removed


_SITE_SOURCE = Path(__file__).with_name("verifier_site.py").read_text()


def verifier_site_source(workdir: str) -> str:
    """`verifier_site`'s text with the agent's working directory set (test.sh's `sitecustomize`)."""
    return _SITE_SOURCE.replace("\nWORKDIR = None ", f"\nWORKDIR = {workdir!r} ", 1)


async def run_verifier(sandbox, harbor: HarborTask, step: HarborStep, state: dict[str, Any], *,
                       allow_env: Collection[str] = ()) -> None:
    """Upload tests/ (then the step's) to /tests, run /tests/test.sh, read the rewards into `state`.

    The reward files are printed by the wrapper the moment test.sh exits; then every process left in the sandbox
    is killed and the files are read again: a change in between (a process the tests started, rewriting the
    reward) is tampering, scored 0 and counted. reward.json counts only where the task's tests write it, or
    where reward.txt agrees with it.
    """
    if getattr(sandbox, "network_note", None):
        state.setdefault("network_notes", []).append(f"verifier {step.name}: {sandbox.network_note}")
    await sandbox.exec(["/bin/sh", "-c", f"mkdir -p {REWARD_DIR} /tests && "
                        f"rm -f {REWARD_DIR}/reward.json {REWARD_DIR}/reward.txt"], timeout=30)
    sources = [Path(harbor.folder) / "tests", Path(harbor.folder) / step.folder / "tests"]
    for source in dict.fromkeys(sources):
        if source.is_dir():
            await sandbox.upload(source, "/tests")
    await sandbox.exec(["chmod", "+x", "/tests/test.sh"], timeout=30)
    await sandbox.write_file(f"{SITE_DIR}/sitecustomize.py", verifier_site_source(sandbox.config.workdir))
    await allow_apt_as_root(sandbox)
    env = resolve_env(step.verifier_env, where=f"{harbor.folder}: [verifier] env", allowed=allow_env)
    # A carried repo's core.fsmonitor ran when test.sh ran `git status` and wrote the output itself (red team,
    # 2026-12-07, paid 1.0); the task's own [verifier] env may still set any of these.
    env = {**_NO_AGENT_CODE_ENV, **env}
    marker = f"@@agentrl-rewards:{secrets.token_hex(8)}"
    result = await sandbox.exec(["/bin/sh", "-c", _wrapper(marker, workdir=sandbox.config.workdir)],
                                timeout=step.verifier_timeout_s, env=env)
    try:
        await sandbox.kill_processes()  # nothing the tests started may write a reward from here on
        unkilled = 0
    except ProcessesSurvived as error:  # forks the kill could not stop: nothing read after this is trusted
        unkilled = error.count
    state["verifier_exit_code"] = result.exit_code
    state["verifier_output"] = result.stderr[-2000:]
    state.setdefault("tests_ran", []).append(not result.timed_out)
    printed = None if result.timed_out else _rewards_snapshot(result.stdout, marker)
    snapshot, (survivors, changed, suspicious) = printed or ({}, (0, 0, 0))
    rewards, error, tampered = None, "", False
    if result.timed_out:
        error = f"tests/test.sh timed out after {step.verifier_timeout_s:g} s"
    elif printed is None:
        error, tampered = "the verifier's reward channel (its stdout) holds output the wrapper did not write", True
    elif result.exit_code > 128 or result.exit_code < 0:  # killed: by the code under test, after a reward
        error, tampered = f"tests/test.sh was killed by signal {abs(result.exit_code) % 128}", True
    elif survivors or unkilled:  # they could have rewritten a reward between test.sh writing it and exiting
        error, tampered = (f"{survivors or unkilled} processes the tests started still ran when tests/test.sh exited"
                           + (" and outlived the kill" if unkilled else "")), True
    elif changed:  # e.g. a line appended to test.sh while bash was reading it
        error, tampered = f"{changed} files of /tests were changed or removed while tests/test.sh ran", True
    elif suspicious:  # e.g. a reward the tests' code wrote and made read-only before test.sh wrote its own
        error, tampered = (f"{suspicious} of {REWARD_DIR} and its reward files were left as tests/test.sh cannot "
                           "have written them (a link, or not writable by their owner)"), True
    else:
        after = {}
        for name in _REWARD_FILES:
            probe = await sandbox.exec(["cat", f"{REWARD_DIR}/{name}"], timeout=30)
            if probe.exit_code == 0:
                after[name] = probe.stdout
        if after != snapshot:
            error, tampered = "the reward files changed after tests/test.sh exited", True
        else:
            rewards, error, tampered = _accepted_rewards(snapshot, json_allowed=task_writes_reward_json(harbor, step))
            if rewards is None and not error:
                error = f"tests/test.sh wrote no reward to {REWARD_DIR}"
    if tampered:
        state["tamper_suspected"] = True
        error = "tampering suspected: " + error
    if error:
        prefix = f"step {step.name}: " if harbor.multi_step else ""
        state["verifier_error"] = state.get("verifier_error") or prefix + error
    state["step_rewards"].append(rewards)


def settle_rewards(harbor: HarborTask, state: dict[str, Any]) -> None:
    """The trial's rewards from its steps' (Harbor's per-key mean or the final step's), and the reward."""
    steps = state.get("step_rewards")
    if not steps:
        return
    if harbor.reward_strategy == "final" or len(steps) == 1:
        rewards = steps[-1] or {}
    else:
        counted = [step for step in steps if step is not None]
        keys = sorted({key for step in counted for key in step})
        rewards = {key: sum(step.get(key, 0.0) for step in counted) / len(counted) for key in keys}
    state["rewards"] = rewards
    state["verifier_reward"] = combine_rewards(rewards, harbor.primary_reward)


def below_min_reward(rewards: dict[str, float] | None, minimum: float | dict[str, float] | None) -> bool:
    """Harbor's min_reward: a float gates the 'reward' key, a table each of its keys (missing = -inf)."""
    if minimum is None:
        return False
    thresholds = minimum if isinstance(minimum, dict) else {"reward": minimum}
    return any((rewards or {}).get(key, -math.inf) < value for key, value in thresholds.items())
