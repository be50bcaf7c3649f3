"""End to end with the real harness CLIs: Claude Code, Codex and OpenClaw, unchanged, through the proxy.

Each harness is installed from npm (``scripts/harnesses/install.sh``, cached), configured only by base
URL and key as a rollout would be, and run headless in a temporary workspace on a two-turn tool task.
The model behind the proxy is the *scripted* engine (:mod:`scripted_engine`): it speaks vLLM's
chat-completions contract with token ids, but follows a script (call the shell tool, then report its
output), because a model that can actually pick tools does not run on these machines. The proxy and
the Kafka broker are real; every call the harness makes is read back from Kafka and compared with what
the engine saw and sampled.

The runs are offline: telemetry, update checks and non-essential traffic are switched off, and each
harness only ever reaches the proxy on loopback. A harness that cannot be installed or run fails the
test; nothing here is skipped.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from netutil import free_port
from proxy_helpers import RunningProxy, proxy_in_front_of, read_events
from scripted_engine import MODEL, THOUGHT, WEIGHT_VERSION, Fault, ScriptedEngine, SeenCall, first_turn, has_tool_result

from proxy.anthropic.translate import BILLING_LINE
from schemas import ModelCallV1
from schemas.call.v1 import ApiProtocol, CallStatus
from stream import CALLS, KafkaSettings, TopicRegistry

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(1800)]

REPO = Path(__file__).resolve().parents[2]
INSTALLER = REPO / "scripts" / "harnesses" / "install.sh"
INSTALL_TIMEOUT_S = 1500
RUN_TIMEOUT_S = 240

# The tool call the script makes. Its output ("openforge-42") is not in the command's text, so seeing
# it in the final answer (and in result.txt) proves the harness really ran the command.
COMMAND = "printf 'openforge-%s\\n' \"$((6*7))\" > result.txt && cat result.txt"
EXPECTED_OUTPUT = "openforge-42"
PROMPT = "Run the shell command that writes result.txt in this folder, then tell me what it printed."


@pytest.fixture(scope="session")
def harness_bin() -> Path:
    """Folder with the ``claude``, ``codex`` and ``openclaw`` wrappers (installed once, cached)."""
    started = time.monotonic()
    try:
        done = subprocess.run(["bash", str(INSTALLER)], capture_output=True, text=True,
                              timeout=INSTALL_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{INSTALLER.name} did not finish in {INSTALL_TIMEOUT_S}s:\n{_tail(exc.stderr)}")
    if done.returncode != 0:
        pytest.fail(f"{INSTALLER.name} failed (exit {done.returncode}):\n{_tail(done.stderr)}")
    lines = done.stdout.strip().splitlines()
    bin_dir = Path(lines[-1]) if lines else Path()
    missing = [cli for cli in ("claude", "codex", "openclaw") if not (bin_dir / cli).is_file()]
    if missing:
        pytest.fail(f"{INSTALLER.name} printed {bin_dir} but it lacks {missing}:\n{_tail(done.stderr)}")
    print(f"harness CLIs ready in {time.monotonic() - started:.1f}s: {bin_dir}")
    return bin_dir


# --------------------------------------------------------------------------- harnesses


@dataclass
class Run:
    """One harness run: its folders, its rollout, and (after it ran) what it printed."""

    bin_dir: Path
    root: Path
    base_url: str  # the proxy's per-rollout prefix, without /v1
    token: str
    workspace: Path = field(init=False)
    home: Path = field(init=False)
    stdout: str = ""
    stderr: str = ""
    exit_code: int | None = None
    seconds: float = 0.0

    def __post_init__(self) -> None:
        self.workspace = self.root / "workspace"
        self.home = self.root / "home"
        self.workspace.mkdir(parents=True)
        self.home.mkdir(parents=True)

    def base_env(self) -> dict[str, str]:
        """A clean environment: nothing of the host's leaks in (keys, proxies, configs)."""
        return {
            "PATH": f"{self.bin_dir}:/usr/local/bin:/usr/bin:/bin",
            "HOME": str(self.home),
            "LANG": "C.UTF-8",
            "TERM": "dumb",
            "NO_PROXY": "127.0.0.1,localhost",
            "no_proxy": "127.0.0.1,localhost",
        }

    def describe(self) -> str:
        return (f"exit {self.exit_code} after {self.seconds:.1f}s\n--- stdout (tail) ---\n{_tail(self.stdout)}"
                f"\n--- stderr (tail) ---\n{_tail(self.stderr)}")


@dataclass(frozen=True)
class Harness:
    """How to configure and run one harness CLI, and where it puts its final answer."""

    name: str
    protocol: ApiProtocol
    tool: str  # the shell tool the script calls
    command: Callable[[Run], tuple[list[str], dict[str, str]]]
    final_answer: Callable[[Run], str]
    session_header: str | None = None
    """Header naming the harness's session on every call (recorded in ``session_headers``)."""
    new_call_after: dict[str, str] = field(default_factory=dict)
    """Faults after which the harness does not re-send the failed request but makes a different
    one (fault name: how), which the proxy rightly records as a new call, not as a retry."""


def _claude_code(run: Run) -> tuple[list[str], dict[str, str]]:
    env = {
        **run.base_env(),
        "ANTHROPIC_BASE_URL": run.base_url,  # the path prefix is kept: /rollouts/<id>/v1/messages
        "ANTHROPIC_API_KEY": run.token,  # sent as x-api-key
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",  # no telemetry, error reports or update checks
        "DISABLE_AUTOUPDATER": "1",
        "IS_SANDBOX": "1",  # lets --dangerously-skip-permissions run as root (CI containers)
    }
    argv = ["claude", "-p", PROMPT, "--dangerously-skip-permissions", "--output-format", "json", "--max-turns", "6"]
    return argv, env


def _claude_code_answer(run: Run) -> str:
    result = json.loads(run.stdout)
    assert result.get("is_error") is False, result
    return str(result["result"])


def _codex(run: Run, *, default_tools: bool = False) -> tuple[list[str], dict[str, str]]:
    codex_home = run.root / "codex-home"
    codex_home.mkdir()
    # Hosted web search and the sub-agent tool namespace are switched off unless ``default_tools``,
    # so most tests see the smallest request; test_codex_with_its_default_tools keeps both.
    only_functions = "" if default_tools else '''web_search = "disabled"

[agents]
enabled = false
'''
    (codex_home / "config.toml").write_text(f"""\
model = "{MODEL}"
model_provider = "openforge"
check_for_update_on_startup = false
{only_functions}
[model_providers.openforge]
name = "OpenForge proxy"
base_url = "{run.base_url}/v1"
env_key = "OPENFORGE_ROLLOUT_TOKEN"
wire_api = "responses"

[analytics]
enabled = false

[features]
plugins = false
apps = false
""")
    env = {**run.base_env(), "CODEX_HOME": str(codex_home), "OPENFORGE_ROLLOUT_TOKEN": run.token}
    argv = ["codex", "exec", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox", "--json",
            "--output-last-message", str(run.root / "last-message.txt"), PROMPT]
    return argv, env


def _codex_answer(run: Run) -> str:
    return (run.root / "last-message.txt").read_text()


def _openclaw(run: Run, api: str = "openai-completions") -> tuple[list[str], dict[str, str]]:
    # The Anthropic adapter appends /v1/messages to the base URL, the OpenAI ones /chat/completions
    # or /responses.
    base_url = run.base_url if api == "anthropic-messages" else f"{run.base_url}/v1"
    config = {
        "update": {"checkOnStart": False},
        "models": {
            "mode": "replace",
            "providers": {
                "openforge": {
                    "baseUrl": base_url,
                    "apiKey": "${OPENFORGE_ROLLOUT_TOKEN}",
                    "api": api,
                    "models": [{"id": MODEL, "name": "OpenForge scripted engine", "reasoning": False,
                                "input": ["text"], "cost": {"input": 0, "output": 0, "cacheRead": 0, "cacheWrite": 0},
                                "contextWindow": 128000, "maxTokens": 4096}],
                },
            },
        },
        "agents": {"defaults": {"model": {"primary": f"openforge/{MODEL}"}}},
    }
    path = run.root / "openclaw.json5"
    path.write_text(json.dumps(config, indent=2))
    env = {**run.base_env(), "OPENFORGE_ROLLOUT_TOKEN": run.token, "OPENCLAW_NO_AUTO_UPDATE": "1",
           "OPENCLAW_DISABLE_BONJOUR": "1"}
    argv = ["openclaw", "agent", "exec", "--config", str(path), "--model", f"openforge/{MODEL}", "--json",
            "--timeout", str(RUN_TIMEOUT_S - 30), "--cwd", str(run.workspace), PROMPT]
    return argv, env


def _openclaw_answer(run: Run) -> str:
    result = json.loads(run.stdout)
    assert result.get("status") == "ok", result
    return str(result["final"])


HARNESSES = [
    Harness("claude-code", ApiProtocol.ANTHROPIC_MESSAGES, "Bash", _claude_code, _claude_code_answer,
            session_header="x-claude-code-session-id"),
    Harness("codex", ApiProtocol.OPENAI_RESPONSES, "exec_command", _codex, _codex_answer,
            session_header="session-id"),
    Harness("openclaw", ApiProtocol.OPENAI_CHAT, "exec", _openclaw, _openclaw_answer, new_call_after={
        # Its transport re-sends a cut stream as is, but after an HTTP 5xx it retries the whole agent
        # turn with the user message rewritten ("[Queued user message from a previous active turn ...]
        # ... Continue the current task ...").
        "retried-503": "agent-level retry with a rewritten user message",
        # It takes finish_reason "abort" (passed on as the engine sent it) for a failed turn too.
        "retried-aborted": "agent-level retry with a rewritten user message"}),
]
# OpenClaw can speak the two translated protocols too: a second client for each translation.
OTHER_CLIENTS = [
    Harness("openclaw-responses", ApiProtocol.OPENAI_RESPONSES, "exec",
            functools.partial(_openclaw, api="openai-responses"), _openclaw_answer),
    Harness("openclaw-messages", ApiProtocol.ANTHROPIC_MESSAGES, "exec",
            functools.partial(_openclaw, api="anthropic-messages"), _openclaw_answer),
]


async def run_harness(harness: Harness, run: Run) -> None:
    """Run the CLI to completion (bounded); its output lands on ``run``."""
    argv, env = harness.command(run)
    argv = [str(run.bin_dir / argv[0]), *argv[1:]]
    out_path, err_path = run.root / "stdout.txt", run.root / "stderr.txt"
    started = time.monotonic()
    with out_path.open("wb") as out, err_path.open("wb") as err:
        process = await asyncio.create_subprocess_exec(
            *argv, cwd=run.workspace, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
            start_new_session=True)  # its own process group, so a timeout kills its children too
        try:
            run.exit_code = await asyncio.wait_for(process.wait(), RUN_TIMEOUT_S)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            await process.wait()
        finally:
            run.seconds = time.monotonic() - started
    run.stdout = out_path.read_text(errors="replace")
    run.stderr = err_path.read_text(errors="replace")
    if run.exit_code is None:
        pytest.fail(f"{harness.name} did not finish in {RUN_TIMEOUT_S}s\n{run.describe()}")


# --------------------------------------------------------------------------- proxy in front of the engine


async def captured_calls(proxy: RunningProxy, expect: int) -> list[ModelCallV1]:
    """The call events on Kafka, in the order they were produced (one rollout: one partition)."""
    events = await read_events(proxy.settings.kafka, proxy.registry, CALLS, expect=expect, timeout_s=30.0)
    assert all(isinstance(e, ModelCallV1) for e in events), events
    return events


def check_capture(harness: Harness, rollout_id: str, seen: list[SeenCall], events: list[ModelCallV1]) -> None:
    """Every call the engine saw is on Kafka, in order, with the exact ids and logprobs it produced."""
    assert len(events) == len(seen), (
        f"the engine saw {len(seen)} calls ({[s.kind for s in seen]}) but Kafka holds {len(events)} "
        f"({[(e.status.value, e.error_message) for e in events]})")
    starts = [e.timings.started_at for e in events]
    assert starts == sorted(starts), "call events are not in the order the calls were made"
    assert len({e.call_id for e in events}) == len(events)
    for i, (call, event) in enumerate(zip(seen, events, strict=True)):
        where = f"call {i} ({call.kind})"
        assert event.rollout_id == rollout_id, where
        assert event.protocol is harness.protocol, where
        assert event.streamed == call.streamed, where
        assert event.model == MODEL, where
        # Recorded as the engine received it: the translated chat request, tools included.
        assert event.request.messages == call.body["messages"], where
        # Claude Code's attribution line is for Anthropic's API, which takes it out: the engine never sees it.
        assert BILLING_LINE not in json.dumps(call.body["messages"]), where
        assert event.request.tools == call.body.get("tools"), where
        if call.kind == "fault":  # the engine answered with an HTTP error
            assert event.status is CallStatus.UPSTREAM_ERROR, where
            assert event.upstream_status_code == call.status, where
            assert list(event.prompt_token_ids) == [] and event.choices == [], where
            continue
        if call.kind == "aborted":  # the engine cut the answer short: what was sampled is kept, marked failed
            assert event.status is CallStatus.UPSTREAM_ERROR, where
            assert list(event.prompt_token_ids) == call.prompt_token_ids, where
            assert [list(c.completion_token_ids) for c in event.choices] == [call.completion_token_ids], where
            assert [list(c.logprobs) for c in event.choices] == [call.logprobs], where
            assert event.choices[0].finish_reason == "abort", where
            continue
        if call.kind == "dropped":  # the stream was cut: what was sampled is kept, marked failed
            assert event.status is CallStatus.UPSTREAM_ERROR, where
            assert list(event.prompt_token_ids) == call.prompt_token_ids, where
            assert [list(c.completion_token_ids) for c in event.choices] == [call.completion_token_ids], where
            assert [list(c.logprobs) for c in event.choices] == [call.logprobs], where
            assert event.choices[0].finish_reason is None, where
            continue
        assert event.status is CallStatus.OK, f"{where}: {event.status} {event.error_message}"
        assert list(event.prompt_token_ids) == call.prompt_token_ids, where
        assert len(event.choices) == 1, where
        choice = event.choices[0]
        assert list(choice.completion_token_ids) == call.completion_token_ids, where
        assert list(choice.logprobs) == call.logprobs, where
        assert [(v.version, v.start, v.end) for v in choice.weight_versions] == \
            [(WEIGHT_VERSION, 0, len(call.completion_token_ids))], where
        assert choice.finish_reason == ("tool_calls" if call.kind == "tool_call" else "stop"), where
        assert event.usage is not None, where
        assert event.usage.prompt_tokens == len(call.prompt_token_ids), where
        assert event.usage.completion_tokens == len(call.completion_token_ids), where
        # The harness's credential never reaches the record.
        assert not {"authorization", "x-api-key"} & set(event.session_headers), where


# --------------------------------------------------------------------------- the tests


FAULTS: dict[str, list[Fault]] = {
    "clean": [],
    # The first tool-choosing request is answered 503 once: the harness must retry it.
    "retried-503": [Fault(match=first_turn, status=503)],
    # Its stream is cut after two chunks (no finish, no [DONE]) once: the harness must retry it.
    "retried-dropped-stream": [Fault(match=first_turn, drop_after=2)],
    # Its answer ends after two pieces with finish_reason "abort" once (vLLM paused in its default
    # mode): the harness must not take half a tool call for an answer, but send the call again.
    "retried-aborted": [Fault(match=first_turn, abort_after=2)],
}


class UnlinkedRetryError(AssertionError):
    """The harness re-sent a failed call's prompt, but the proxy recorded it as a new call."""


def _cases() -> list[Any]:
    cases = [pytest.param(harness, fault, id=f"{harness.name}-{fault}") for harness in HARNESSES for fault in FAULTS]
    cases += [pytest.param(harness, "clean", id=f"{harness.name}-clean") for harness in OTHER_CLIENTS]
    return cases


@pytest.mark.parametrize(("harness", "fault"), _cases())
async def test_harness_completes_tool_task_and_every_call_is_captured(
        harness: Harness, fault: str, harness_bin: Path, kafka_settings: KafkaSettings, topics: TopicRegistry,
        tmp_path: Path) -> None:
    # After an injected failure, the proxy must record the failed call and link the harness's
    # re-sent request to it as attempt 1 (retry_of = the failed call's id).
    faults = [dataclasses.replace(f) for f in FAULTS[fault]]
    engine = ScriptedEngine(command=COMMAND, faults=faults)
    rollout_id = f"e2e-{harness.name}-{uuid.uuid4().hex[:8]}"
    async with engine.running(free_port()) as engine_url, \
            proxy_in_front_of(engine_url, kafka_settings, topics, tmp_path) as proxy:
        run = Run(harness_bin, tmp_path / harness.name, proxy.base(rollout_id), proxy.token(rollout_id))
        await run_harness(harness, run)
    print(f"{harness.name} ({fault}): {run.seconds:.1f}s, {len(engine.seen)} calls")

    # The harness finished the two-turn task: the tool really ran and its output came back.
    assert run.exit_code == 0, run.describe()
    kinds = [c.kind for c in engine.seen]
    assert "tool_call" in kinds and "final" in kinds[kinds.index("tool_call"):], f"{kinds}\n{run.describe()}"
    tool_calls = [c for c in engine.seen if c.kind == "tool_call"]
    assert {c.tool_name for c in tool_calls} == {harness.tool}, [c.tool_name for c in tool_calls]
    result_file = run.workspace / "result.txt"
    assert result_file.is_file(), f"the tool did not run in the workspace\n{run.describe()}"
    assert result_file.read_text().strip() == EXPECTED_OUTPUT
    final = next(c for c in engine.seen if c.kind == "final")
    assert EXPECTED_OUTPUT in final.text, "the tool's output did not reach the model in the tool result"
    assert EXPECTED_OUTPUT in harness.final_answer(run), run.describe()

    # Every call on Kafka, in order, token-exact.
    events = await captured_calls(proxy, expect=len(engine.seen))
    check_capture(harness, rollout_id, engine.seen, events)

    if harness.session_header:
        sessions = {e.session_headers.get(harness.session_header) for e in events}
        assert len(sessions) == 1 and None not in sessions, sessions

    # Retries: exactly the injected failure was retried, and linked to it.
    retries = [e for e in events if e.attempt > 0]
    if not faults:
        assert retries == [] and all(e.retry_of is None for e in events)
        return
    assert [f.fired for f in faults] == [1], "the fault was never injected"
    failed = [e for e in events if e.status is CallStatus.UPSTREAM_ERROR]
    assert len(failed) == 1, [(e.status, e.attempt) for e in events]
    after = events[events.index(failed[0]) + 1]
    assert after.status is CallStatus.OK
    if fault in harness.new_call_after:
        # A different request is a new call: recorded as a first attempt, the failure standing alone.
        assert retries == [], [(e.status.value, e.attempt, e.retry_of) for e in events]
        assert after.request.messages != failed[0].request.messages
        return
    if retries != [after]:
        same_prompt = after.request.messages == failed[0].request.messages and \
            after.request.tools == failed[0].request.tools
        raise UnlinkedRetryError(
            f"the harness re-sent the failed call ({'same' if same_prompt else 'a different'} prompt; streamed "
            f"{failed[0].streamed} -> {after.streamed}, sampling {failed[0].request.sampling} -> "
            f"{after.request.sampling}) but the proxy did not link it as a retry: "
            f"{[(e.status.value, e.attempt, e.retry_of) for e in events]}; last messages "
            f"{failed[0].request.messages[-2:]} -> {after.request.messages[-2:]}")
    assert after.attempt == 1
    assert after.retry_of == failed[0].call_id
    assert after.request.messages == failed[0].request.messages


async def test_codex_with_its_default_tools(harness_bin: Path, kafka_settings: KafkaSettings, topics: TopicRegistry,
                                            tmp_path: Path) -> None:
    codex = next(h for h in HARNESSES if h.name == "codex")
    engine = ScriptedEngine(command=COMMAND)
    rollout_id = f"e2e-codex-default-{uuid.uuid4().hex[:8]}"
    async with engine.running(free_port()) as engine_url, \
            proxy_in_front_of(engine_url, kafka_settings, topics, tmp_path) as proxy:
        run = Run(harness_bin, tmp_path / "codex", proxy.base(rollout_id), proxy.token(rollout_id))
        await run_harness(dataclasses.replace(codex, command=lambda r: _codex(r, default_tools=True)), run)
    assert run.exit_code == 0, run.describe()
    # The sub-agent namespace reached the engine as flat function names; hosted web search did not.
    offered = {t["function"]["name"] for t in engine.seen[0].body.get("tools", [])}
    assert "multi_agent_v1__spawn_agent" in offered, sorted(offered)
    assert not any("web_search" in name for name in offered)
    assert (run.workspace / "result.txt").read_text().strip() == EXPECTED_OUTPUT
    events = await captured_calls(proxy, expect=len(engine.seen))
    check_capture(codex, rollout_id, engine.seen, events)


def _tail(text: Any, limit: int = 4000) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    text = str(text or "")
    return text if len(text) <= limit else "..." + text[-limit:]


@pytest.mark.parametrize("harness", [h for h in HARNESSES if h.protocol is not ApiProtocol.OPENAI_CHAT],
                         ids=lambda h: h.name)
async def test_a_thinking_models_reasoning_comes_back_to_the_engine_on_the_next_turn(
        harness: Harness, harness_bin: Path, kafka_settings: KafkaSettings, topics: TopicRegistry,
        tmp_path: Path) -> None:
    # The model thinks before each answer. The harness gets that thinking in its API's own place
    # (a thinking block, a reasoning item), keeps it in its history, and sends it back: the engine
    # must see it on the assistant turn that made the tool call, as the chat template renders it.
    # It thinks for a second, with a short keep-alive: Claude Code asks for its thinking omitted
    # (display "omitted"), so it hears pings meanwhile (test_stream_keepalive_with_scripted_engine
    # shows they are sent), and must read past them.
    engine = ScriptedEngine(command=COMMAND, reasoning=(3, 0.35))
    rollout_id = f"e2e-think-{harness.name}-{uuid.uuid4().hex[:8]}"
    async with engine.running(free_port()) as engine_url, \
            proxy_in_front_of(engine_url, kafka_settings, topics, tmp_path, stream_keepalive_s=0.25) as proxy:
        run = Run(harness_bin, tmp_path / harness.name, proxy.base(rollout_id), proxy.token(rollout_id))
        await run_harness(harness, run)
    assert run.exit_code == 0, run.describe()
    assert EXPECTED_OUTPUT in harness.final_answer(run), run.describe()
    final = next(c for c in engine.seen if c.kind == "final")
    turns = [m for m in final.body["messages"] if m.get("role") == "assistant" and m.get("tool_calls")]
    assert [m.get("reasoning") for m in turns] == [THOUGHT * 3], final.body["messages"]
    events = await captured_calls(proxy, expect=len(engine.seen))
    check_capture(harness, rollout_id, engine.seen, events)


# vLLM's words for a prompt over the model's context (0.10 and later); the proxy says it in each API's own.
_OVERFLOW = ("This model's maximum context length is 4096 tokens. However, your prompt contains 5000 input tokens, "
             "which exceeds this limit even without any output tokens. Please reduce the length of the input "
             "prompt. (parameter=input_tokens, value=5000)")


async def _second_turn_over_the_context(harness: Harness, harness_bin: Path, kafka_settings: KafkaSettings,
                                        topics: TopicRegistry, tmp_path: Path) -> tuple[Run, ScriptedEngine]:
    """The task, with the engine refusing the turn after the tool's result once, as too long for its context."""
    engine = ScriptedEngine(command=COMMAND, faults=[Fault(match=has_tool_result, status=400, message=_OVERFLOW)])
    rollout_id = f"e2e-{harness.name}-full-{uuid.uuid4().hex[:8]}"
    async with engine.running(free_port()) as engine_url, \
            proxy_in_front_of(engine_url, kafka_settings, topics, tmp_path) as proxy:
        run = Run(harness_bin, tmp_path / harness.name, proxy.base(rollout_id), proxy.token(rollout_id))
        await run_harness(harness, run)
        events = await captured_calls(proxy, expect=len(engine.seen))
    print(f"{harness.name}: {[c.kind for c in engine.seen]}")
    check_capture(harness, rollout_id, engine.seen, events)
    refused = [e for e in events if e.status is CallStatus.UPSTREAM_ERROR]
    assert [(e.upstream_status_code, e.error_message) for e in refused] == [(400, _OVERFLOW)], refused
    assert engine.seen[1].kind == "fault" and has_tool_result(engine.seen[1].body), [c.kind for c in engine.seen]
    return run, engine


async def test_claude_code_compacts_a_conversation_the_engine_finds_too_long_and_finishes(
        harness_bin: Path, kafka_settings: KafkaSettings, topics: TopicRegistry, tmp_path: Path) -> None:
    """Told "prompt is too long: N tokens > M maximum" (the engine's refusal, a 400 in Anthropic's
    words), Claude Code asks the model for a summary of the conversation, goes on from it and
    finishes the task. Every call, the refused one and the summary's, is on Kafka, in order."""
    claude = next(h for h in HARNESSES if h.name == "claude-code")
    run, engine = await _second_turn_over_the_context(claude, harness_bin, kafka_settings, topics, tmp_path)
    assert run.exit_code == 0, run.describe()
    assert EXPECTED_OUTPUT in claude.final_answer(run), run.describe()
    summary = engine.seen[2]
    assert summary.kind == "final" and "<summary>" in json.dumps(summary.body["messages"][-1]), summary.body
    assert len(engine.seen) > 3 and engine.seen[-1].kind == "final", [c.kind for c in engine.seen]


async def test_codex_reports_a_full_context_when_the_engine_finds_the_conversation_too_long(
        harness_bin: Path, kafka_settings: KafkaSettings, topics: TopicRegistry, tmp_path: Path) -> None:
    """Codex knows a full context by OpenAI's code context_length_exceeded: it ends the turn saying
    so, where any other refusal is an invalid request to it."""
    codex = next(h for h in HARNESSES if h.name == "codex")
    run, engine = await _second_turn_over_the_context(codex, harness_bin, kafka_settings, topics, tmp_path)
    assert run.exit_code != 0, run.describe()
    lines = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    failed = [line for line in lines if line.get("type") == "turn.failed"]
    assert len(failed) == 1 and "context window" in failed[0]["error"]["message"], run.describe()
    assert len(engine.seen) == 2, [c.kind for c in engine.seen]
