"""Calls the assembler cannot join token for token go to the dead-letter topic with the reason, never padded or cut.

Each misaligned record is written to the real broker as bytes (a producer that validates could
not write it), beside well-formed rollouts, and the assembler must dead-letter exactly those.
"""

from __future__ import annotations

import base64

import orjson
import pytest
from assembler_factories import conversation, lifecycle, reward
from linear_calls import linked
from test_assembler_service import fast_settings, publish, read_topic

from consumers.assembler.service import AssemblerService
from schemas import DeadLetterV1, ModelCallV1, TrajectoryV1, encode
from schemas.call.linear import UnresolvedPrefix
from schemas.rollout.v1 import RolloutPhase
from stream.producer import EventProducer
from stream.settings import KafkaSettings
from stream.topics import CALLS, DEAD_LETTERS, TRAJECTORIES, TopicRegistry

pytestmark = pytest.mark.kafka


def _bent(event: ModelCallV1, change: dict) -> tuple[bytes, list[tuple[str, bytes]]]:
    """The event's record with a field of its first choice changed as no validating producer would write it."""
    value, headers = encode(event)
    body = orjson.loads(value)
    body["choices"][0].update(change)
    return orjson.dumps(body), headers


async def test_each_misalignment_is_dead_lettered_with_its_reason(
    kafka_settings: KafkaSettings, topics: TopicRegistry
) -> None:
    calls = conversation("r-bent", 3, seed=7)
    first, second, third = calls
    # Linear and whole: the good rollout's second and third calls reference the call before.
    good = [lifecycle("r-bent", RolloutPhase.SCHEDULED), first, linked(second, first), linked(third, second),
            lifecycle("r-bent", RolloutPhase.SUCCEEDED), reward("r-bent", 1.0)]
    missing = linked(conversation("r-x", 2, seed=8)[1], conversation("r-x", 2, seed=8)[0])
    past_end = linked(second, first, len(second.prompt_token_ids)).model_copy(update={"call_id": "r-bent-past"})
    mismatch = linked(second, first, digest="0" * 32).model_copy(update={"call_id": "r-bent-mismatch"})
    sampled = len(first.choices[0].completion_token_ids)
    extra_logprob = _bent(first.model_copy(update={"call_id": "r-bent-lp"}),
                          {"logprobs": base64.b64encode(bytes(8 * (sampled + 1))).decode()})
    version_past_end = _bent(first.model_copy(update={"call_id": "r-bent-v"}),
                             {"weight_versions": [{"version": "1", "start": 0, "end": 99}]})
    async with EventProducer(kafka_settings) as producer:
        await publish(producer, good[:2])
        for event in (missing, past_end, mismatch):  # valid events whose reference does not resolve
            await producer.send(CALLS, event)
        for value, headers in (extra_logprob, version_past_end):
            await producer.send_raw(topics[CALLS].name, value, key=b"r-bent", headers=headers)
        await publish(producer, good[2:])
        async with AssemblerService(fast_settings(kafka_settings), kafka_settings):
            letters = await read_topic(kafka_settings.bootstrap_servers, topics[DEAD_LETTERS].name, expect=5)
            [trajectory] = await read_topic(kafka_settings.bootstrap_servers, topics[TRAJECTORIES].name, expect=1)
    assert all(isinstance(letter, DeadLetterV1) for letter in letters)
    reasons = sorted(letter.reason for letter in letters)
    assert len(reasons) == 5, reasons
    assert sum(r.startswith(UnresolvedPrefix.PARENT_MISSING.value) for r in reasons) == 1, reasons
    assert sum(r.startswith(UnresolvedPrefix.PAST_PARENT_END.value) for r in reasons) == 1, reasons
    assert sum(r.startswith(UnresolvedPrefix.PREFIX_MISMATCH.value) for r in reasons) == 1, reasons
    assert sum(f"logprobs has {sampled + 1} values but completion_token_ids has {sampled}" in r
               for r in reasons) == 1, reasons
    assert sum("weight_versions" in r and "99" in r for r in reasons) == 1, reasons
    # The well-formed calls around them joined whole, token for token, into one sample.
    assert isinstance(trajectory, TrajectoryV1)
    [sample] = trajectory.samples
    assert sample.call_ids == [c.call_id for c in calls]
    assert list(sample.prompt_ids) == list(first.prompt_token_ids)
    assert list(sample.prompt_ids) + list(sample.completion_ids) == (
        list(third.prompt_token_ids) + list(third.choices[0].completion_token_ids))
    assert sample.origins and sample.loss_mask.count_trained() == sum(len(c.choices[0].completion_token_ids)
                                                                     for c in calls)
