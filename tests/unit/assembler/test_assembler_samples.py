"""Sample building: prefix merging, loss masks, logprobs, weight version ranges, skipped calls."""

from __future__ import annotations

import random

import pytest
from assembler_factories import call

from consumers.assembler.samples import build_samples, order_calls, usable_calls
from schemas.call.v1 import CallStatus


def test_calls_that_extend_the_context_merge_into_one_sample_with_context_masked() -> None:
    first = call([1, 2, 3], [10, 11], call_id="a", logprobs=[-0.1, -0.2])
    # Prompt = previous prompt + completion + a tool result [7, 8].
    second = call([1, 2, 3, 10, 11, 7, 8], [12], call_id="b", logprobs=[-0.3])
    built = build_samples([first, second])
    [sample] = built.samples
    assert list(sample.prompt_ids) == [1, 2, 3]
    assert list(sample.completion_ids) == [10, 11, 7, 8, 12]
    assert list(sample.loss_mask) == [1, 1, 0, 0, 1]
    assert list(sample.behavior_logprobs) == [-0.1, -0.2, 0.0, 0.0, -0.3]
    assert sample.call_ids == ["a", "b"]
    assert (built.stats.calls, built.stats.merged, built.stats.breaks, built.stats.skipped) == (2, 1, 0, 0)
    assert built.breaks == []


def test_prompt_equal_to_the_context_merges_without_context_tokens() -> None:
    built = build_samples([call([1], [2], call_id="a"), call([1, 2], [3], call_id="b")])
    [sample] = built.samples
    assert list(sample.completion_ids) == [2, 3]
    assert list(sample.loss_mask) == [1, 1]


def test_a_rewritten_prompt_starts_a_new_sample_and_counts_a_break() -> None:
    first = call([1, 2, 3], [10, 11], call_id="a")
    # Like OpenClaw's ephemeral trailing message: the history diverges after 4 tokens.
    second = call([1, 2, 3, 10, 99, 7], [12, 13], call_id="b")
    third = call([1, 2, 3, 10, 99, 7, 12, 13, 5], [14], call_id="c")
    built = build_samples([first, second, third])
    assert [s.call_ids for s in built.samples] == [["a"], ["b", "c"]]
    assert list(built.samples[1].prompt_ids) == [1, 2, 3, 10, 99, 7]
    assert list(built.samples[1].loss_mask) == [1, 1, 0, 1]
    assert (built.stats.merged, built.stats.breaks) == (1, 1)
    [brk] = built.breaks
    assert (brk.call_id, brk.context_tokens, brk.common_prefix_tokens) == ("b", 5, 4)


def test_a_shorter_prompt_is_a_break_even_when_it_is_a_prefix() -> None:
    built = build_samples([call([1, 2, 3], [4], call_id="a"), call([1, 2], [5], call_id="b")])
    assert len(built.samples) == 2
    assert built.breaks[0].common_prefix_tokens == 2


def test_weight_versions_are_shifted_into_completion_coordinates_and_coalesced() -> None:
    first = call([1], [2, 3, 4], call_id="a", versions=[("5", 0, 2), ("6", 2, 3)])
    second = call([1, 2, 3, 4, 9, 9], [7, 8], call_id="b", versions=[("6", 0, 1), ("7", 1, 2)])
    third = call([1, 2, 3, 4, 9, 9, 7, 8], [1], call_id="c", versions=[("7", 0, 1)])
    [sample] = build_samples([first, second, third]).samples
    # completion: 2 3 4 | 9 9 | 7 8 | 1 ; "6" ends at 3 but resumes at 5 (after context): two ranges.
    got = [(r.version, r.start, r.end) for r in sample.weight_versions]
    assert got == [("5", 0, 2), ("6", 2, 3), ("6", 5, 6), ("7", 6, 8)]


def test_a_call_without_versions_makes_the_sample_versions_unknown() -> None:
    first = call([1], [2], call_id="a", versions=[("1", 0, 1)])
    second = call([1, 2], [3], call_id="b", versions=[])
    [sample] = build_samples([first, second]).samples
    assert sample.weight_versions == []


def test_failed_calls_and_superseded_attempts_are_skipped() -> None:
    ok = call([1], [2], call_id="a")
    failed = call([1, 2], [], call_id="b", status=CallStatus.UPSTREAM_ERROR)
    retried = call([1, 2, 5], [6], call_id="c")  # ok, but the harness retried it anyway
    retry = call([1, 2, 5], [7], call_id="d", retry_of="c", attempt=1)
    disconnected = call([1, 2, 5, 7], [8], call_id="e", status=CallStatus.CLIENT_DISCONNECTED)
    calls = [ok, failed, retried, retry, disconnected]
    assert [c.call_id for c in usable_calls(calls)] == ["a", "d"]
    built = build_samples(calls)
    [sample] = built.samples
    assert sample.call_ids == ["a", "d"]
    assert list(sample.completion_ids) == [2, 5, 7]
    assert (built.stats.calls, built.stats.skipped, built.stats.merged) == (5, 3, 1)


def test_no_usable_calls_give_no_samples() -> None:
    built = build_samples([call([1], [], call_id="a", status=CallStatus.UPSTREAM_TIMEOUT)])
    assert built.samples == []
    assert (built.stats.calls, built.stats.skipped, built.stats.breaks) == (1, 1, 0)
    assert build_samples([]).stats.calls == 0


def test_order_calls_sorts_by_start_and_drops_repeated_call_ids() -> None:
    late = call([1, 2], [3], call_id="b", at=5)
    early = call([1], [2], call_id="a", at=1)
    again = call([1], [2], call_id="a", at=1)
    assert [c.call_id for c in order_calls([late, early, again])] == ["a", "b"]


@pytest.mark.parametrize("seed", range(40))
def test_property_samples_reproduce_every_call_token_exactly(seed: int) -> None:
    """Random conversations with random breaks: each call's prompt+completion is recoverable."""
    rng = random.Random(seed)
    calls = []
    context: list[int] = [rng.randrange(50) for _ in range(rng.randrange(1, 6))]
    for index in range(rng.randrange(1, 12)):
        if rng.random() < 0.25:  # the harness rewrote history
            context = [rng.randrange(50) for _ in range(rng.randrange(1, len(context) + 2))]
        completion = [rng.randrange(50) for _ in range(rng.randrange(1, 5))]
        cut = rng.randrange(len(completion) + 1)
        versions = [(str(index), 0, cut), (str(index + 1), cut, len(completion))]
        versions = [v for v in versions if v[1] < v[2]]
        calls.append(call(context, completion, call_id=f"c{index}", versions=versions,
                          logprobs=[-rng.random() for _ in completion]))
        context = context + completion + [rng.randrange(50) for _ in range(rng.randrange(0, 4))]
    built = build_samples(calls)
    stats = built.stats
    assert stats.calls == stats.skipped + stats.merged + stats.breaks + (1 if built.samples else 0)
    assert len(built.samples) == stats.breaks + 1
    by_id = {c.call_id: c for c in calls}
    for sample in built.samples:
        sequence = list(sample.prompt_ids) + list(sample.completion_ids)
        trained = [i for i, m in enumerate(sample.loss_mask) if m == 1]
        expected_trained: list[int] = []
        for call_id in sample.call_ids:
            original = by_id[call_id]
            choice = original.choices[0]
            start = len(original.prompt_token_ids)
            # The call's prompt is a prefix of the sample; its completion follows, trained.
            assert sequence[:start] == list(original.prompt_token_ids)
            n = len(choice.completion_token_ids)
            assert sequence[start:start + n] == list(choice.completion_token_ids)
            offset = start - len(sample.prompt_ids)
            expected_trained.extend(range(offset, offset + n))
            assert list(sample.behavior_logprobs)[offset:offset + n] == list(choice.logprobs)
            for item in choice.weight_versions:  # every token keeps its version
                for token in range(item.start, item.end):
                    owner = [r for r in sample.weight_versions if r.start <= offset + token < r.end]
                    assert [r.version for r in owner] == [item.version]
        assert trained == expected_trained
        assert all(lp == 0.0 for lp, m in zip(sample.behavior_logprobs, sample.loss_mask, strict=True) if m == 0)


def test_every_token_has_an_origin_and_the_mask_is_derived_from_them() -> None:
    from schemas import ModelCallV1
    from schemas.call.v1 import NormalizedRequest
    from schemas.trajectory.v1 import TokenOrigin

    def asking(event: ModelCallV1, *messages: dict[str, str]) -> ModelCallV1:
        return event.model_copy(update={"request": NormalizedRequest(messages=list(messages))})

    user = {"role": "user", "content": "hi"}
    answer = {"role": "assistant", "content": "ok"}
    first = asking(call([1, 2, 3], [10, 11], call_id="a"), user)
    second = asking(call([1, 2, 3, 10, 11, 7, 8], [12], call_id="b"), user, answer, {"role": "tool", "content": "x"})
    third = asking(call([1, 2, 3, 10, 11, 7, 8, 12, 5], [13], call_id="c"), user, answer, {"role": "tool", "content": "x"},
                   answer, {"role": "user", "content": "more"})
    [sample] = build_samples([first, second, third]).samples
    spans = [(s.origin, s.start, s.end) for s in sample.origins]
    assert spans == [(TokenOrigin.USER, 0, 3), (TokenOrigin.SAMPLED, 3, 5), (TokenOrigin.TOOL, 5, 7),
                     (TokenOrigin.SAMPLED, 7, 8), (TokenOrigin.USER, 8, 9), (TokenOrigin.SAMPLED, 9, 10)]
    assert list(sample.loss_mask) == [1, 1, 0, 0, 1, 0, 1]


@pytest.mark.parametrize(("spans", "error"), [
    ([("user", 0, 2), ("sampled", 2, 5)], "runs past the end"),
    ([("user", 0, 2), ("sampled", 2, 3)], "cover 3 tokens but the sequence has 4"),
    ([("user", 0, 2), ("sampled", 3, 4)], "without gaps"),
    ([("sampled", 0, 4)], "marks prompt tokens sampled"),
])
def test_origins_that_do_not_align_with_the_tokens_are_refused(spans: list[tuple[str, int, int]], error: str) -> None:
    from schemas.trajectory.v1 import TrajectorySample

    with pytest.raises(ValueError, match=error):
        TrajectorySample.model_validate({
            "prompt_ids": [1, 2], "completion_ids": [3, 4], "loss_mask": [1, 1], "behavior_logprobs": [-1.0, -1.0],
            "call_ids": ["a"], "origins": [{"origin": o, "start": s, "end": e} for o, s, e in spans]})


def test_a_mask_other_than_the_origins_imply_is_refused() -> None:
    from schemas.trajectory.v1 import TrajectorySample

    with pytest.raises(ValueError, match="differs from the mask the origins imply"):
        TrajectorySample.model_validate({
            "prompt_ids": [1, 2], "completion_ids": [3, 4], "loss_mask": [1, 0], "behavior_logprobs": [-1.0, -1.0],
            "call_ids": ["a"], "origins": [{"origin": "user", "start": 0, "end": 2},
                                           {"origin": "sampled", "start": 2, "end": 4}]})
