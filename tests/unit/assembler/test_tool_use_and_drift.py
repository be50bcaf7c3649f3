"""Error-recovery annotations and drift reasons, on rollouts recorded as harnesses make them."""

from __future__ import annotations

import pytest
from aiokafka.structs import TopicPartition
from flight_events import NOT_RECOVERED, RECOVERED, Turn, tool_rollout

from consumers.assembler.drift import diagnose_break
from consumers.assembler.settings import AssemblerSettings
from consumers.assembler.state import RolloutTable
from consumers.assembler.tools import ToolErrorRules, annotate_tool_use
from schemas import DriftReason, ModelCallV1, ToolErrorRule, TrajectoryV1
from schemas.call.v1 import ApiProtocol, NormalizedRequest

RULES = ToolErrorRules.of()


def assembled(*recorded: object) -> dict[str, TrajectoryV1]:
    table = RolloutTable()
    tp = TopicPartition("calls", 0)
    for offset, event in enumerate(e for r in recorded for e in r.events()):  # type: ignore[attr-defined]
        table.add(event, tp, offset, 0.0)
    return {f.trajectory.rollout_id: f.trajectory for f in table.due(100.0)}


def test_a_failing_tool_call_and_a_successful_retry_is_recovered() -> None:
    trajectory = assembled(tool_rollout("r", RECOVERED))["r"]
    assert trajectory.tool_use is not None
    assert (trajectory.tool_use.tool_calls, trajectory.tool_use.results, trajectory.tool_use.errors,
            trajectory.tool_use.recovered) == (2, 2, 1, 1)
    [error] = trajectory.tool_errors
    assert (error.tool_call_id, error.tool_name, error.rule, error.recovered, error.recovered_by) == (
        "r-t0", "shell", ToolErrorRule.EXIT_CODE, True, "r-t1")
    assert error.call_id == "r-c1"  # the call whose request first carried the failing result


def test_a_failing_tool_call_without_a_retry_is_not_recovered() -> None:
    trajectory = assembled(tool_rollout("r", NOT_RECOVERED))["r"]
    assert trajectory.tool_use is not None and (trajectory.tool_use.errors, trajectory.tool_use.recovered) == (1, 0)
    [error] = trajectory.tool_errors
    assert (error.rule, error.recovered, error.recovered_by) == (ToolErrorRule.ERROR_TEXT, False, None)


def test_anthropic_is_error_marks_a_result_whatever_its_text() -> None:
    turns = [Turn("cat notes.md", "the file is empty", is_error=True), Turn(text="nothing to do")]
    use, errors = annotate_tool_use(tool_rollout("r", turns, protocol=ApiProtocol.ANTHROPIC_MESSAGES).calls, RULES)
    assert [e.rule for e in errors] == [ToolErrorRule.IS_ERROR] and use.recovered == 0


def test_a_success_of_another_tool_does_not_count_as_recovery() -> None:
    turns = [Turn("make", "Exit code: 2"), Turn("ls", "Makefile", tool="list_files"), Turn(text="gave up")]
    _, errors = annotate_tool_use(tool_rollout("r", turns).calls, RULES)
    assert [(e.tool_name, e.recovered) for e in errors] == [("shell", False)]


@pytest.mark.parametrize(("text", "rule"), [
    ("Exit code: 1\nWall time: 0.1 seconds", ToolErrorRule.EXIT_CODE),
    ("Process exited with code 127", ToolErrorRule.EXIT_CODE),
    ('{"output": "boom", "metadata": {"exit_code": 2}}', ToolErrorRule.EXIT_CODE),
    ("Exit code: 0\nerror: a line the program printed", None),  # the exit code decides
    ("<tool_use_error>File does not exist.</tool_use_error>", ToolErrorRule.ERROR_TEXT),
    ("Traceback (most recent call last):\n  File ...", ToolErrorRule.ERROR_TEXT),
    ("fatal: not a git repository", ToolErrorRule.ERROR_TEXT),
    ("all 12 tests passed", None),
])
def test_default_rules_for_results_without_a_protocol_flag(text: str, rule: ToolErrorRule | None) -> None:
    assert RULES.judge({"role": "tool", "tool_call_id": "t", "content": text}) is rule


def test_the_rules_are_configurable_and_a_bad_pattern_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENFORGE_ASSEMBLER_TOOL_ERROR_PATTERNS", '["^FAILED"]')
    rules = AssemblerSettings().tool_error_rules()
    assert rules.judge({"role": "tool", "content": "FAILED: 3 tests"}) is ToolErrorRule.ERROR_TEXT
    assert rules.judge({"role": "tool", "content": "<tool_use_error>x</tool_use_error>"}) is None
    monkeypatch.setenv("OPENFORGE_ASSEMBLER_TOOL_ERROR_PATTERNS", '["(unclosed"]')
    with pytest.raises(ValueError, match="does not compile"):
        AssemblerSettings()


def test_tool_call_parse_failures_are_counted() -> None:
    calls = tool_rollout("r", [Turn(text='<tool_call>{"name": "shell"'), Turn(text="done")]).calls
    broken = calls[1].model_copy(update={"response": {"choices": [{"message": {
        "role": "assistant", "content": None,
        "tool_calls": [{"id": "x", "type": "function", "function": {"name": "shell", "arguments": "{not json"}}]}}]}})
    use, _ = annotate_tool_use([calls[0], broken], RULES)
    assert use.parse_failures == 2


def test_a_harness_that_keeps_its_history_merges_every_turn() -> None:
    trajectory = assembled(tool_rollout("r", RECOVERED))["r"]
    assert (trajectory.merge_stats.merged, trajectory.merge_stats.breaks, len(trajectory.samples)) == (2, 0, 1)
    assert trajectory.merge_breaks == []


def test_a_context_message_moved_every_turn_breaks_every_join_and_is_named() -> None:
    trajectory = assembled(tool_rollout("r", RECOVERED, moving_context=True))["r"]
    assert trajectory.merge_stats.breaks == 2
    assert [(b.call_id, b.sample_index, b.reason) for b in trajectory.merge_breaks] == [
        ("r-c1", 1, DriftReason.MESSAGE_MOVED), ("r-c2", 2, DriftReason.MESSAGE_MOVED)]
    assert all(0 < b.common_prefix_tokens < b.context_tokens for b in trajectory.merge_breaks)


def _with_request(call: ModelCallV1, messages: list[object], tools: object = "same") -> ModelCallV1:
    return call.model_copy(update={"request": NormalizedRequest(
        messages=messages, tools=call.request.tools if tools == "same" else tools)})


def test_drift_reasons_from_the_messages() -> None:
    first, second, _ = tool_rollout("r", RECOVERED).calls
    assert diagnose_break(first, second) is DriftReason.RERENDERED  # same history: only the tokens differ
    assert diagnose_break(first, _with_request(second, list(second.request.messages), tools=[])) \
        is DriftReason.TOOLS_CHANGED
    rewritten = [second.request.messages[0], {"role": "user", "content": "Summary of the work so far."},
                 *second.request.messages[2:]]
    assert diagnose_break(first, _with_request(second, rewritten)) is DriftReason.HISTORY_REWRITTEN
    thinking = first.model_copy(update={"response": {"choices": [{"message": {
        **first.response["choices"][0]["message"], "reasoning": "I should run the tests."}}]}})  # type: ignore[index]
    assert diagnose_break(thinking, second) is DriftReason.REASONING_DROPPED
    # Arguments re-serialised with other spacing are the same call to the template's eye.
    respaced = [dict(m) for m in second.request.messages]
    call = respaced[2]["tool_calls"][0]  # type: ignore[index]
    respaced[2] = {**respaced[2], "tool_calls": [{**call, "function": {**call["function"],  # type: ignore[dict-item]
                                                                       "arguments": '{ "command": "pytest -x" }'}}]}
    assert diagnose_break(first, _with_request(second, respaced)) is DriftReason.RERENDERED
