"""verifiers v1 Tasksets (verifiers >= 0.4) run by agentrl, rewards equal to verifiers' own.

Fixtures: tests/fixtures/verifiers/v1_reverse (no runtime: two weighted async rewards, a metric)
and v1_files (NEEDS_CONTAINER: setup writes into the box, the agent's bash tool works there,
finalize and runtime-reading rewards; runs in real Docker sandboxes). The reference is verifiers
itself: a Trace built from verifiers' own types scored by `Task.score`, and for v1_files the same
bash commands run in verifiers' own SubprocessRuntime with its setup, finalize and scoring.
Skipped, with the reason, where verifiers >= 0.4 is not installed.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from sandbox_backends import BACKENDS

verifiers = pytest.importorskip(
    "verifiers", reason="verifiers is not installed (tests/integration/test_verifiers_venvs.py runs this in its venv)"
)
from packaging.version import Version  # noqa: E402

if Version(verifiers.__version__) < Version("0.4.0"):
    pytest.skip(
        f"verifiers {verifiers.__version__} is installed; these tests need verifiers>=0.4 (its v1 API)",
        allow_module_level=True,
    )
import verifiers.v1 as vf  # noqa: E402

import agentrl  # noqa: E402
from agentrl.errors import AgentrlError  # noqa: E402
from agentrl.policies import ScriptedPolicy, tool_call  # noqa: E402
from agentrl.sampling import SamplingConfig  # noqa: E402

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "verifiers"


def _reference_trace(vf_task, messages):
    """A Trace made with verifiers' own types only: the messages as one chain, model replies sampled."""
    from verifiers.v1.configs.agent import AgentConfig
    from verifiers.v1.graph import MessageNode
    from verifiers.v1.trace import AgentInfo, Trace, TraceTask

    trace = Trace(
        task=TraceTask(type=type(vf_task).__name__, data=vf_task.data), agent=AgentInfo(config=AgentConfig())
    )
    for index, message in enumerate(messages):
        trace.nodes.append(
            MessageNode(
                parent=index - 1 if index else None,
                message=message,
                sampled=isinstance(message, vf.AssistantMessage),
            )
        )
    return trace


def _scores(trace):
    return trace.reward, {**{name: r.score for name, r in trace.rewards.items()}, **trace.metrics}


REVERSE_CASES = [(0, "desserts"), (1, "reward"), (1, "rewards!"), (2, "LEVEL"), (3, "")]


@pytest.mark.parametrize(
    ("index", "reply"), REVERSE_CASES, ids=[f"task{i}-{r or 'empty'}" for i, r in REVERSE_CASES]
)
def test_v1_rewards_equal_verifiers_own(index, reply):
    env = agentrl.load_environment(FIXTURES / "v1_reverse")
    assert env.harness == "null" and env.tool_schemas is None
    task = env.tasks("test")[index]
    rollouts = asyncio.run(env.run_group(ScriptedPolicy([reply]), task, n=2, sampling=SamplingConfig()))
    import vf_v1_reverse

    vf_task = list(vf_v1_reverse.ReverseTaskset(vf_v1_reverse.taskset.ReverseConfig()))[index]
    trace = _reference_trace(
        vf_task,
        [
            vf.SystemMessage(content=vf_task.data.system_prompt),
            vf.UserMessage(content=vf_task.data.prompt),
            vf.AssistantMessage(content=reply),
        ],
    )
    asyncio.run(vf_task.score(trace))
    reward, metrics = _scores(trace)
    for rollout in rollouts:
        assert rollout.error is None
        assert rollout.reward == pytest.approx(reward)
        assert rollout.metrics == pytest.approx(metrics)
        assert set(rollout.metrics) == {"exact", "similarity", "reply_chars"}


def test_v1_rows_and_config_options():
    env = agentrl.load_environment(FIXTURES / "v1_reverse", num_tasks=2)
    assert env.splits == ["test", "train"]
    tasks = env.tasks("train")
    assert [task.example_id for task in tasks] == ["word-0", "word-1"]
    assert [m.role for m in tasks[0].prompt] == ["system", "user"]
    assert tasks[1].prompt[1].content == "Reverse this word: drawer"
    assert tasks[1].info["data"]["word"] == "drawer" and tasks[1].info["verifiers_task"] == 1
    with pytest.raises(AgentrlError, match=r"bad options for ReverseConfig.*num_taskz") as caught:
        agentrl.load_environment(FIXTURES / "v1_reverse", num_taskz=2)
    assert "\n" not in str(caught.value)


def _docker_ready() -> bool:
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "info"], capture_output=True).returncode == 0


needs_docker = pytest.mark.skipif(not _docker_ready(), reason="needs a running Docker engine")


def _containers_of_this_process() -> list[str]:
    listed = subprocess.run(
        ["docker", "ps", "-aq", "--filter", f"label=agentrl.pid={os.getpid()}"],
        capture_output=True,
        text=True,
        check=True,
    )
    return listed.stdout.split()


FILE_CASES = [
    (0, "awk '{s+=$1} END {print s}' numbers.txt > answer.txt", "The sum is 42."),
    (1, "echo 11 > answer.txt", "10"),
    (2, "echo 99 > numbers.txt; echo 99 > answer.txt", "99"),
    (2, "true", "I did nothing."),
]


async def _verifiers_reference_with_runtime(vf_task, command: str, reply: str):
    """verifiers' own runtime (SubprocessRuntime): setup, the agent's command, finalize, score."""
    from verifiers.v1.runtimes.subprocess import SubprocessConfig, SubprocessRuntime

    runtime = SubprocessRuntime(SubprocessConfig())
    await runtime.start()
    try:
        trace = _reference_trace(vf_task, [])
        await vf_task.setup(trace, runtime)
        output = await runtime.run(["bash", "-c", command], {})
        call = vf.ToolCall(id="c1", name="bash", arguments="{}")
        trace = _reference_trace(
            vf_task,
            [
                vf.UserMessage(content=vf_task.data.prompt),
                vf.AssistantMessage(content="", tool_calls=[call]),
                vf.ToolMessage(tool_call_id="c1", content=output.stdout + output.stderr),
                vf.AssistantMessage(content=reply),
            ],
        )
        await vf_task.finalize(trace, runtime)
        await vf_task.score(trace, runtime)
        return trace
    finally:
        await runtime.stop()
        shutil.rmtree(runtime.workdir, ignore_errors=True)


@needs_docker
@pytest.mark.parametrize(
    ("index", "command", "reply"), FILE_CASES, ids=[f"task{c[0]}-{i}" for i, c in enumerate(FILE_CASES)]
)
def test_v1_runtime_task_in_agentrl_sandboxes(index, command, reply):
    env = agentrl.load_environment(FIXTURES / "v1_files")
    assert env.harness == "bash" and env.tool_schemas[0]["function"]["name"] == "bash"
    task = env.tasks("test")[index]
    script = [{"tool_calls": [tool_call("bash", command=command)]}, reply]
    [rollout] = asyncio.run(env.run_group(ScriptedPolicy(script), task, n=1, sampling=SamplingConfig()))
    assert rollout.error is None, rollout.error
    import vf_v1_files

    vf_task = list(vf_v1_files.SumFilesTaskset(vf.TasksetConfig()))[index]
    trace = asyncio.run(_verifiers_reference_with_runtime(vf_task, command, reply))
    reward, metrics = _scores(trace)
    assert rollout.reward == pytest.approx(reward)
    assert rollout.metrics == pytest.approx(metrics)
    assert set(metrics) == {"answer_file", "input_untouched", "said_the_sum"}
    assert _containers_of_this_process() == []  # the agent's and the grading sandboxes are gone


_BOXES: dict[str, str] = {}


class _Data(vf.TaskData):
    pass


class _BoxTask(vf.Task[_Data]):
    """Marks the agent's box outside its workdir; scoring says if it sees the mark or an agent process."""

    NEEDS_CONTAINER = True

    async def setup(self, trace: vf.Trace, runtime: vf.Runtime) -> None:
        _BOXES["setup"] = str((await runtime.run(["sh", "-c", "echo 1 > /tmp/agent-box"], {})).exit_code)

    @vf.reward
    async def no_agent_process(self, runtime: vf.Runtime) -> float:
        _BOXES["scoring"] = str((await runtime.run(["test", "-e", "/tmp/agent-box"], {})).exit_code)
        seen = await runtime.run(["sh", "-c", "cat /proc/[0-9]*/cmdline | tr '\\0' ' '"], {})
        return float("sleep 1000" not in seen.stdout)


@pytest.mark.parametrize("backend", BACKENDS)
def test_v1_scoring_runs_out_of_the_agents_reach(backend):
    """The agent leaves `sleep 1000` running; scoring runs in a fresh sandbox without any agent process."""
    from agentrl.hub.interop.verifiers_v1 import VerifiersTasksetEnv

    env = VerifiersTasksetEnv.from_class(_taskset(_BoxTask), name="box", options={"sandbox": backend})
    script = [
        {"tool_calls": [tool_call("bash", command="sleep 1000 >/dev/null 2>&1 & echo started")]},
        "done",
    ]
    [rollout] = asyncio.run(
        env.run_group(ScriptedPolicy(script), env.tasks("test")[0], n=1, sampling=SamplingConfig())
    )
    assert rollout.error is None, rollout.error
    assert rollout.messages[3].content == "started\n"
    assert rollout.reward == 1.0
    assert _BOXES == {"setup": "0", "scoring": "1"}  # /tmp of the agent's box is not where scoring ran
    if backend["type"] == "docker":
        assert _containers_of_this_process() == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_v1_runtime_task_under_each_backend(backend):
    index, command, reply = FILE_CASES[0]
    env = agentrl.load_environment(FIXTURES / "v1_files", sandbox=backend)
    script = [{"tool_calls": [tool_call("bash", command=command)]}, reply]
    [rollout] = asyncio.run(
        env.run_group(ScriptedPolicy(script), env.tasks("test")[index], n=1, sampling=SamplingConfig())
    )
    assert rollout.error is None, rollout.error
    import vf_v1_files

    vf_task = list(vf_v1_files.SumFilesTaskset(vf.TasksetConfig()))[index]
    reward, metrics = _scores(asyncio.run(_verifiers_reference_with_runtime(vf_task, command, reply)))
    assert (rollout.reward, rollout.metrics) == (pytest.approx(reward), pytest.approx(metrics))
    assert reward == 1.25


@needs_docker
def test_v1_imported_package_runs(tmp_path, monkeypatch):
    import sys

    from agentrl.hub.interop.verifiers import import_verifiers_package
    from agentrl.hub.package import validate_package

    out = import_verifiers_package(FIXTURES / "v1_files", out=tmp_path / "sums")
    for name in [name for name in sys.modules if name == "vf_v1_files" or name.startswith("vf_v1_files.")]:
        monkeypatch.delitem(sys.modules, name)  # one module of a name per process
    manifest, splits = validate_package(out)
    assert len(splits["test"]) == 3 and manifest.requirements == ["verifiers>=0.4.0"]
    env = agentrl.load_environment(out)
    script = [{"tool_calls": [tool_call("bash", command="echo 10 > answer.txt")]}, "10"]
    [rollout] = asyncio.run(
        env.run_group(ScriptedPolicy(script), env.tasks("test")[1], n=1, sampling=SamplingConfig())
    )
    assert rollout.reward == 1.25


class _PlainTask(vf.Task[_Data]):
    @vf.reward
    async def one(self, trace: vf.Trace) -> float:
        return 1.0


class _EchoToolset(vf.Toolset[vf.ToolsetConfig]):
    @vf.tool
    def echo(self, text: str) -> str:
        """Echo."""
        return text


class _ToolTask(_PlainTask):
    @classmethod
    def toolsets(cls, config):
        return [_EchoToolset(vf.ToolsetConfig(colocated=True))]


def _taskset(task_class, **data):
    class OneTaskset(vf.Taskset[task_class, vf.TasksetConfig]):
        def load(self):
            return [task_class(_Data(prompt="hi", **data), self.config.task)]

    return OneTaskset


class _ForeverTaskset(vf.Taskset[_PlainTask, vf.TasksetConfig]):
    INFINITE = True

    def load(self):
        index = 0
        while True:
            yield _PlainTask(_Data(prompt=f"task {index}"), self.config.task)
            index += 1


class _UnreadableTaskset(vf.Taskset[_PlainTask, vf.TasksetConfig]):
    def load(self):
        raise RuntimeError("could not read\ntasks.parquet")


@pytest.mark.parametrize(
    ("taskset", "message"),
    [
        # was `error: RuntimeError: could not read tasks.parquet`, naming neither the package nor load() (a walk-through)
        (_UnreadableTaskset, r"^verifiers taskset 't': loading its tasks failed: RuntimeError: could not read "
                             r"tasks.parquet$"),
        (_taskset(_ToolTask), "MCP toolset _EchoToolset is colocated"),
        (_taskset(_PlainTask, agent_user="alice"), "agent_user='alice'"),
        (_taskset(_PlainTask, resources={"gpu": "A100"}), "asks for GPU 'A100'"),
        (_ForeverTaskset, "is infinite; pass max_tasks=N"),
    ],
)
def test_v1_refusals_are_one_line(taskset, message):
    from agentrl.hub.interop.verifiers_v1 import VerifiersTasksetEnv

    with pytest.raises(AgentrlError, match=message) as caught:
        VerifiersTasksetEnv.from_class(taskset, name="t", options={})
    assert "\n" not in str(caught.value)


def test_v1_infinite_taskset_with_max_tasks():
    from agentrl.hub.interop.verifiers_v1 import VerifiersTasksetEnv

    env = VerifiersTasksetEnv.from_class(_ForeverTaskset, name="forever", options={"max_tasks": 3})
    assert [task.prompt[-1].content for task in env.tasks("test")] == ["task 0", "task 1", "task 2"]
    [rollout] = asyncio.run(
        env.run_group(ScriptedPolicy(["ok"]), env.tasks("test")[2], n=1, sampling=SamplingConfig())
    )
    assert rollout.reward == 1.0 and rollout.metrics == {"one": 1.0}


def test_v1_trace_stop_conditions():
    import vf_v1_reverse

    from agentrl.hub.interop.verifiers_v1 import build_trace
    from agentrl.types import Rollout

    vf_task = list(vf_v1_reverse.ReverseTaskset(vf_v1_reverse.taskset.ReverseConfig()))[0]
    env = agentrl.load_environment(FIXTURES / "v1_reverse")
    task = env.tasks("test")[0]
    rollout = asyncio.run(
        env.rollout(ScriptedPolicy(["x" * 50]), task, sampling=SamplingConfig(max_tokens=8))
    )
    trace = build_trace(vf_task, rollout)
    assert rollout.truncated and trace.is_truncated and trace.stop_condition == "agent_completed"
    done = build_trace(
        vf_task, Rollout(task=task, messages=[*task.prompt], state={"stop_reason": "max_turns"})
    )
    assert done.stop_condition == "max_turns" and done.ok and done.is_truncated


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"harness": "claude_code"}, "harness must be 'null' or 'bash', got 'claude_code'"),
        ({"sandbox": {"type": "qemu"}}, "bad sandbox option: .*type"),
    ],
)
def test_v1_bad_adapter_options_are_one_line(options, message):
    with pytest.raises(AgentrlError, match=message) as caught:
        agentrl.load_environment(FIXTURES / "v1_reverse", **options)
    assert "\n" not in str(caught.value)
