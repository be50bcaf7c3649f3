"""The pod watcher against the real API server and broker; the test plays the kubelet."""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import AsyncIterator

import pytest
from assembled import assemble, counted_in_groups
from assembler_factories import call
from kubeapi import make_spec, make_task
from kubernetes_asyncio import client as k8s
from kubernetes_asyncio.client.exceptions import ApiException

from consumers.rollouts.kubernetes import KubernetesBackend
from producers.pod_watcher import PodWatcher
from schemas.call.v1 import CallStatus
from schemas.failures import FailureReason
from schemas.rollout.pod import ANNOTATION_PUBLISHED, FINALIZER, LABEL_MANAGED_BY
from schemas.rollout.v1 import Backend, RolloutPhase, RolloutReason
from stream import CALLS

pytestmark = [pytest.mark.kube, pytest.mark.kafka]


def assert_no_repeats(log) -> None:
    counts = Counter((e.rollout_id, e.phase) for e in log.events)
    assert all(n == 1 for n in counts.values()), f"repeated: {[k for k, n in counts.items() if n > 1]}"


async def _launch(kube_settings, specs) -> None:
    async with KubernetesBackend(kube_settings) as backend:
        for spec in specs:
            assert await backend.launch(spec)


async def _gone(core, name: str, namespace: str, timeout_s: float = 15.0) -> bool:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while loop.time() < deadline:
        try:
            await core.read_namespaced_pod(name, namespace)
        except ApiException as exc:
            if exc.status == 404:
                return True
            raise
        await asyncio.sleep(0.2)
    return False


async def test_scheduled_running_succeeded_once_each_with_group_fields(
        kube_settings, kube_admin, kube_namespace, kubelet, event_log, start_watcher) -> None:
    watcher = await start_watcher()
    task = make_task(group_size=2)
    spec = make_spec(task, 1)
    await _launch(kube_settings, [spec])
    await event_log.wait_for(lambda: event_log.phases(spec.rollout_id) == ["scheduled"], what="scheduled")

    await kubelet.bind(spec.name)
    await kubelet.harness_running(spec.name)
    await event_log.wait_for(lambda: event_log.phases(spec.rollout_id) == ["scheduled", "running"], what="running")
    await kubelet.verifier_running(spec.name)
    await kubelet.finish(spec.name, phase="Succeeded")
    await event_log.wait_for(lambda: len(event_log.of(spec.rollout_id)) == 3, what="succeeded")
    await event_log.settle()

    events = event_log.of(spec.rollout_id)
    assert [e.phase for e in events] == [RolloutPhase.SCHEDULED, RolloutPhase.RUNNING, RolloutPhase.SUCCEEDED]
    for e in events:
        assert (e.task_id, e.run_id, e.group_index, e.group_size, e.harness) == (
            task.task_id, "run-7", 1, 2, "coding-agent")
        assert (e.backend, e.pod_name, e.namespace) == (Backend.KUBERNETES, spec.name, kube_namespace)
    assert (events[2].harness_exit_code, events[2].verifier_exit_code, events[2].reason) == (0, 0, None)
    assert not events[2].infrastructure_failure
    pod = await k8s.CoreV1Api(kube_admin).read_namespaced_pod(spec.name, kube_namespace)
    assert pod.metadata.annotations[ANNOTATION_PUBLISHED] == "scheduled,running,succeeded"
    assert watcher.stats.published == 3


async def test_failures_carry_reasons_and_mark_infrastructure_apart(
        kube_settings, kube_admin, kube_namespace, kubelet, event_log, start_watcher, watcher_settings,
        kafka_settings, topics, producer) -> None:
    await start_watcher(watcher_settings.model_copy(update={"image_pull_timeout_s": 0.0,
                                                             "unschedulable_timeout_s": 1.0}))
    task = make_task(group_size=11)
    specs = [make_spec(task, i) for i in range(11)]
    (exit_code, oom, verifier, deadline, evicted, image, unschedulable, node_lost, no_reward, never_ends,
     upstream) = specs
    await _launch(kube_settings, specs)
    for spec in [*specs[:5], *specs[7:]]:
        await kubelet.bind(spec.name)
        await kubelet.harness_running(spec.name)
    await kubelet.finish(exit_code.name, phase="Failed", harness_exit=3, harness_reason="Error", verifier_exit=None)
    await kubelet.finish(oom.name, phase="Failed", harness_exit=137, harness_reason="OOMKilled", verifier_exit=None)
    await kubelet.verifier_running(verifier.name)
    await kubelet.finish(verifier.name, phase="Failed", verifier_exit=2, verifier_reason="Error")
    await kubelet.finish(deadline.name, phase="Failed", harness_exit=137, harness_reason="Error", verifier_exit=None,
                         pod_reason="DeadlineExceeded", message="Pod was active on the node longer than 600 s")
    await kubelet.finish(evicted.name, phase="Failed", harness_exit=137, verifier_exit=None, pod_reason="Evicted",
                         message="The node was low on resource: memory.")
    await kubelet.bind(image.name)
    await kubelet.image_pull_failing(image.name)
    await kubelet.unschedulable(unschedulable.name)
    await kubelet.lose_node(node_lost.name)
    await kubelet.finish(no_reward.name, phase="Succeeded")  # and no verifier ever reports a reward
    # The harness's last call got a 503 from the engine, and it exited 1 (the test plays the proxy here).
    for index, (status, code) in enumerate([(CallStatus.OK, 200), (CallStatus.UPSTREAM_ERROR, 503)]):
        made = call([1, 2], [3] if status is CallStatus.OK else [], call_id=f"u{index}",
                    rollout_id=upstream.rollout_id, status=status, at=index)
        await producer.publish(CALLS, made.model_copy(update={"upstream_status_code": code}))
    await kubelet.finish(upstream.name, phase="Failed", harness_exit=1, harness_reason="Error", verifier_exit=None)

    ending = [s for s in specs if s is not never_ends]  # its pod runs on; nothing says it ended
    await event_log.wait_for(lambda: all(any(RolloutPhase(p).is_terminal for p in event_log.phases(s.rollout_id))
                                         for s in ending), timeout_s=30, what="terminal events")
    await event_log.settle()
    assert_no_repeats(event_log)
    last = {s.rollout_id: event_log.of(s.rollout_id)[-1] for s in specs}

    def outcome(spec):
        e = last[spec.rollout_id]
        return e.phase, e.reason, e.infrastructure_failure

    assert outcome(exit_code) == (RolloutPhase.FAILED, RolloutReason.EXIT_CODE, False)
    assert last[exit_code.rollout_id].harness_exit_code == 3
    assert outcome(oom) == (RolloutPhase.FAILED, RolloutReason.OOM_KILLED, True)
    assert outcome(verifier) == (RolloutPhase.FAILED, RolloutReason.VERIFIER_FAILED, True)
    assert last[verifier.rollout_id].verifier_exit_code == 2
    assert outcome(deadline) == (RolloutPhase.TIMED_OUT, RolloutReason.DEADLINE_EXCEEDED, False)
    assert outcome(evicted) == (RolloutPhase.FAILED, RolloutReason.EVICTED, True)
    assert "low on resource" in (last[evicted.rollout_id].message or "")
    assert outcome(image) == (RolloutPhase.FAILED, RolloutReason.IMAGE_PULL, True)
    assert "ImagePullBackOff" in (last[image.rollout_id].message or "")
    assert outcome(unschedulable) == (RolloutPhase.FAILED, RolloutReason.UNSCHEDULABLE, True)
    assert event_log.phases(unschedulable.rollout_id) == ["scheduled", "failed"]
    assert event_log.phases(exit_code.rollout_id) == ["scheduled", "running", "failed"]
    assert outcome(node_lost) == (RolloutPhase.FAILED, RolloutReason.NODE_LOST, True)
    assert outcome(upstream) == (RolloutPhase.FAILED, RolloutReason.EXIT_CODE, False)  # all the pod shows
    assert event_log.phases(never_ends.rollout_id) == ["scheduled", "running"]

    # What the assembler makes of them: only the policy's own failures enter the group's statistics.
    trajectories = await assemble(kafka_settings, topics, [s.rollout_id for s in specs])
    verdicts = {s.rollout_id: (trajectories[s.rollout_id].failure_reason,
                               trajectories[s.rollout_id].infrastructure_failure) for s in specs}
    F = FailureReason
    assert verdicts == {
        exit_code.rollout_id: (F.EXIT_CODE, False), deadline.rollout_id: (F.DEADLINE_EXCEEDED, False),
        oom.rollout_id: (F.OOM_KILLED, True), verifier.rollout_id: (F.VERIFIER_FAILED, True),
        evicted.rollout_id: (F.EVICTED, True), image.rollout_id: (F.IMAGE_PULL, True),
        unschedulable.rollout_id: (F.UNSCHEDULABLE, True), node_lost.rollout_id: (F.NODE_LOST, True),
        no_reward.rollout_id: (F.REWARD_TIMEOUT, True), never_ends.rollout_id: (F.LIFECYCLE_TIMEOUT, True),
        upstream.rollout_id: (F.UPSTREAM_FAILED, True),
    }
    assert counted_in_groups(trajectories.values()) == {task.task_id: {exit_code.rollout_id, deadline.rollout_id}}

    core = k8s.CoreV1Api(kube_admin)
    # Written-off pods are deleted so they cannot start later; the unscheduled one goes at once, the
    # bound one is marked for graceful deletion (a kubelet would finish it).
    assert await _gone(core, unschedulable.name, kube_namespace)
    pod = await core.read_namespaced_pod(image.name, kube_namespace)
    assert pod.metadata.deletion_timestamp is not None


async def test_finished_pods_are_deleted_after_the_ttl(kube_settings, kube_admin, kube_namespace, kubelet,
                                                       event_log, start_watcher, watcher_settings) -> None:
    watcher = await start_watcher(watcher_settings.model_copy(update={"finished_ttl_s": 2.0}))
    spec = make_spec(make_task(), 0)
    await _launch(kube_settings, [spec])
    await kubelet.bind(spec.name)
    await kubelet.finish(spec.name, phase="Succeeded")
    await event_log.wait_for(lambda: "succeeded" in event_log.phases(spec.rollout_id), what="succeeded")
    core = k8s.CoreV1Api(kube_admin)
    await core.read_namespaced_pod(spec.name, kube_namespace)  # still there within the TTL
    assert await _gone(core, spec.name, kube_namespace, timeout_s=10)
    await event_log.settle()
    assert event_log.phases(spec.rollout_id) == ["scheduled", "running", "succeeded"]
    assert watcher.stats.deleted == 1  # the sweeps after the delete do not send it again


async def test_pods_without_rollout_annotations_are_skipped_and_the_watcher_carries_on(
        kube_settings, kube_admin, kube_namespace, event_log, start_watcher) -> None:
    watcher = await start_watcher()
    core = k8s.CoreV1Api(kube_admin)
    await core.create_namespaced_pod(kube_namespace, {
        "metadata": {"name": "stray", "labels": {LABEL_MANAGED_BY: "openforge"},
                     "annotations": {"openforge.dev/rollout-id": "r", "openforge.dev/group-index": "x"}},
        "spec": {"containers": [{"name": "c", "image": "busybox"}]}})
    spec = make_spec(make_task(), 0)
    await _launch(kube_settings, [spec])
    await event_log.wait_for(lambda: event_log.phases(spec.rollout_id) == ["scheduled"], what="scheduled")
    assert watcher.stats.skipped >= 1
    assert {e.rollout_id for e in event_log.events} == {spec.rollout_id}


async def test_watcher_restart_publishes_missed_phases_and_repeats_none(
        kube_settings, kube_namespace, kubelet, event_log, start_watcher) -> None:
    first = await start_watcher()
    task = make_task(group_size=2)
    a, b = make_spec(task, 0), make_spec(task, 1)
    await _launch(kube_settings, [a])
    await kubelet.bind(a.name)
    await kubelet.harness_running(a.name)
    await event_log.wait_for(lambda: event_log.phases(a.rollout_id) == ["scheduled", "running"], what="running")
    await first.stop()

    # While no watcher runs: a finishes, b is launched and finishes too.
    await kubelet.finish(a.name, phase="Succeeded")
    await _launch(kube_settings, [b])
    await kubelet.bind(b.name)
    await kubelet.finish(b.name, phase="Failed", harness_exit=1, harness_reason="Error", verifier_exit=None)

    await start_watcher()
    await event_log.wait_for(lambda: len(event_log.events) == 6, what="missed phases")
    await event_log.settle()
    assert event_log.phases(a.rollout_id) == ["scheduled", "running", "succeeded"]
    assert event_log.phases(b.rollout_id) == ["scheduled", "running", "failed"]
    assert_no_repeats(event_log)


async def test_watch_expiry_410_relists_and_loses_or_repeats_nothing(
        kube_api, kube_settings, kube_admin, kube_namespace, kubelet, event_log, start_watcher) -> None:
    # A second API server on the same etcd, without a watch cache: its watches read etcd history
    # directly, so once etcd compacts past the watcher's resource version, the server answers 410.
    server = kube_api.spawn_server(watch_cache=False)
    try:
        async with kube_api.client(kube_api.watcher_token, server=server) as client:
            watcher: PodWatcher = await start_watcher(client=client)
            task = make_task(group_size=3)
            specs = [make_spec(task, i) for i in range(3)]
            await _launch(kube_settings, specs[:2])
            await kubelet.bind(specs[0].name)
            await kubelet.harness_running(specs[0].name)
            await event_log.wait_for(lambda: len(event_log.events) == 3, what="first events")

            await asyncio.to_thread(server.stop)  # the watcher loses its server and retries
            # Transitions it cannot see, through the main server.
            await kubelet.finish(specs[0].name, phase="Succeeded")
            await kubelet.bind(specs[1].name)
            await kubelet.finish(specs[1].name, phase="Failed", harness_exit=2, harness_reason="Error",
                                 verifier_exit=None)
            await _launch(kube_settings, specs[2:])
            await k8s.CoreV1Api(kube_admin).create_namespaced_config_map(
                kube_namespace, {"metadata": {"name": "bump"}})  # history past the watcher's version
            compacted = kube_api.compact_etcd()
            await asyncio.to_thread(server.start)

            await event_log.wait_for(lambda: len(event_log.events) == 7, timeout_s=40, what="events after 410")
            await event_log.settle()
            assert watcher.stats.expired >= 1, f"no 410 seen (compacted at {compacted})"
            assert watcher.stats.lists >= 2
    finally:
        await asyncio.to_thread(server.stop)
    assert event_log.phases(specs[0].rollout_id) == ["scheduled", "running", "succeeded"]
    assert event_log.phases(specs[1].rollout_id) == ["scheduled", "running", "failed"]
    assert event_log.phases(specs[2].rollout_id) == ["scheduled"]
    assert_no_repeats(event_log)


async def test_api_server_restart_mid_watch_loses_or_repeats_nothing(
        kube_api, kube_settings, kube_namespace, kubelet, event_log, start_watcher) -> None:
    server = kube_api.spawn_server(watch_cache=True)
    try:
        async with kube_api.client(kube_api.watcher_token, server=server) as client:
            watcher: PodWatcher = await start_watcher(client=client)
            task = make_task(group_size=4)
            specs = [make_spec(task, i) for i in range(4)]
            await _launch(kube_settings, specs[:3])
            await kubelet.bind(specs[0].name)
            await kubelet.harness_running(specs[0].name)
            await event_log.wait_for(lambda: len(event_log.events) == 4, what="first events")

            await asyncio.to_thread(server.stop)
            await kubelet.finish(specs[0].name, phase="Succeeded")
            await kubelet.bind(specs[1].name)
            await kubelet.harness_running(specs[1].name)
            await asyncio.to_thread(server.start)
            # And more after it is back.
            await kubelet.finish(specs[1].name, phase="Failed", harness_exit=1, harness_reason="Error",
                                 verifier_exit=None)
            await _launch(kube_settings, specs[3:])
            await event_log.wait_for(lambda: len(event_log.events) == 8, timeout_s=40, what="events after restart")
            await event_log.settle()
            assert watcher.stats.reconnects >= 1
    finally:
        await asyncio.to_thread(server.stop)
    assert event_log.phases(specs[0].rollout_id) == ["scheduled", "running", "succeeded"]
    assert event_log.phases(specs[1].rollout_id) == ["scheduled", "running", "failed"]
    assert event_log.phases(specs[2].rollout_id) == ["scheduled"]
    assert event_log.phases(specs[3].rollout_id) == ["scheduled"]
    assert_no_repeats(event_log)


async def test_openforge_watcher_process_publishes_and_drains_on_sigterm(
        kube_api, kube_settings, kube_namespace, kafka_settings, event_log) -> None:
    import os
    import signal
    import sys

    env = {**os.environ,
           "OPENFORGE_KUBE_SERVER": kube_api.url, "OPENFORGE_KUBE_TOKEN": kube_api.watcher_token,
           "OPENFORGE_KUBE_CA_FILE": str(kube_api.ca_file), "OPENFORGE_WATCHER_NAMESPACE": kube_namespace,
           "OPENFORGE_KAFKA_BOOTSTRAP_SERVERS": kafka_settings.bootstrap_servers,
           "OPENFORGE_KAFKA_TOPIC_PREFIX": kafka_settings.topic_prefix}
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "openforge", "watcher", env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    try:
        spec = make_spec(make_task(), 0)
        await _launch(kube_settings, [spec])
        await event_log.wait_for(lambda: event_log.phases(spec.rollout_id) == ["scheduled"], timeout_s=60,
                                 what="scheduled from the watcher process")
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
        output, _ = await asyncio.wait_for(process.communicate(), 30)
    assert process.returncode == 0, output.decode(errors="replace")[-2000:]


async def test_a_pod_deleted_while_no_watcher_watched_still_ends_once_then_goes(
        kube_settings, kube_admin, kube_namespace, kubelet, event_log, start_watcher) -> None:
    spec = make_spec(make_task(group_size=1), 0)
    await _launch(kube_settings, [spec])
    first = await start_watcher()
    await kubelet.bind(spec.name)
    await kubelet.harness_running(spec.name)
    await event_log.wait_for(lambda: event_log.phases(spec.rollout_id) == ["scheduled", "running"], what="running")
    await first.stop()
    await kubelet.lose_node(spec.name)  # deleted while nobody watches: the finalizer keeps it
    core = k8s.CoreV1Api(kube_admin)
    held = await core.read_namespaced_pod(spec.name, kube_namespace)
    assert held.metadata.deletion_timestamp is not None and held.metadata.finalizers == [FINALIZER]

    await start_watcher()
    await event_log.wait_for(lambda: len(event_log.of(spec.rollout_id)) == 3, what="the terminal event")
    assert await _gone(core, spec.name, kube_namespace)
    await event_log.settle()
    last = event_log.of(spec.rollout_id)[-1]
    assert (last.phase, last.reason, last.infrastructure_failure) == (RolloutPhase.FAILED, RolloutReason.NODE_LOST, True)
    assert_no_repeats(event_log)


@contextlib.asynccontextmanager
async def _watcher_role_without(kube_admin, namespace: str, verb: str) -> AsyncIterator[None]:
    """The watcher's Role without ``verb`` (as a half-applied RBAC change leaves it) until the block ends."""
    rbac = k8s.RbacAuthorizationV1Api(kube_admin)
    role = await rbac.read_namespaced_role("openforge-pod-watcher", namespace)
    verbs = list(role.rules[0].verbs)
    role.rules[0].verbs = [v for v in verbs if v != verb]
    await rbac.replace_namespaced_role("openforge-pod-watcher", namespace, role)
    try:
        yield
    finally:
        role = await rbac.read_namespaced_role("openforge-pod-watcher", namespace)
        role.rules[0].verbs = verbs
        await rbac.replace_namespaced_role("openforge-pod-watcher", namespace, role)


async def _until_retried(watcher: PodWatcher, times: int, timeout_s: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while watcher.stats.retries < times and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.1)
    assert watcher.stats.retries >= times, watcher.stats


async def test_a_refused_patch_is_retried_for_its_pod_and_the_event_is_not_repeated(
        kube_settings, kube_admin, kube_namespace, kubelet, event_log, start_watcher) -> None:
    # Each pod's changes are handled by its own worker: a patch the API server refuses is retried
    # for that pod after a pause, without publishing the acknowledged phase again, and lands once
    # it is allowed.
    task = make_task(group_size=2)
    specs = [make_spec(task, 0), make_spec(task, 1)]
    async with _watcher_role_without(kube_admin, kube_namespace, "patch"):
        watcher = await start_watcher()
        await _launch(kube_settings, specs)
        for spec in specs:
            await kubelet.bind(spec.name)
            await kubelet.harness_running(spec.name)
        for spec in specs:
            await event_log.wait_for(lambda s=spec: event_log.phases(s.rollout_id) == ["scheduled", "running"],
                                     what="running")
        await _until_retried(watcher, 4)  # each pod's patch was refused and tried again

    core = k8s.CoreV1Api(kube_admin)
    for spec in specs:
        deadline = asyncio.get_running_loop().time() + 30
        while asyncio.get_running_loop().time() < deadline:
            pod = await core.read_namespaced_pod(spec.name, kube_namespace)
            if (pod.metadata.annotations or {}).get(ANNOTATION_PUBLISHED) == "scheduled,running":
                break
            await asyncio.sleep(0.2)
        assert pod.metadata.annotations[ANNOTATION_PUBLISHED] == "scheduled,running", pod.metadata.annotations
    await event_log.settle()
    assert watcher.stats.published == 4  # scheduled (the launcher's id) and running, once per pod
    assert_no_repeats(event_log)


async def test_a_written_off_pod_whose_delete_was_refused_is_deleted_once_allowed(
        kube_settings, kube_admin, kube_namespace, kubelet, event_log, start_watcher, watcher_settings) -> None:
    # A pod written off (here: its image never pulls) must go, or it could still start the rollout
    # whose failure was published. A refused delete is retried although the failure is already on
    # Kafka and nothing new is left to publish.
    spec = make_spec(make_task(group_size=1), 0)
    async with _watcher_role_without(kube_admin, kube_namespace, "delete"):
        watcher = await start_watcher(watcher_settings.model_copy(update={"image_pull_timeout_s": 0.0}))
        await _launch(kube_settings, [spec])
        await kubelet.bind(spec.name)
        await kubelet.image_pull_failing(spec.name)
        await event_log.wait_for(lambda: event_log.phases(spec.rollout_id) == ["scheduled", "failed"],
                                 what="failed")
        await _until_retried(watcher, 2)
        assert watcher.stats.deleted == 0, watcher.stats

    core = k8s.CoreV1Api(kube_admin)
    deadline = asyncio.get_running_loop().time() + 30
    deleting = False
    while not deleting and asyncio.get_running_loop().time() < deadline:
        try:  # a bound pod goes once its kubelet confirms; there is none here, so its deletion is what shows
            deleting = (await core.read_namespaced_pod(spec.name, kube_namespace)).metadata.deletion_timestamp is not None
        except ApiException as exc:
            deleting = exc.status == 404
        await asyncio.sleep(0.2)
    assert deleting, "the written-off pod was not deleted once the watcher could"
    await event_log.settle()
    assert event_log.phases(spec.rollout_id) == ["scheduled", "failed"]
    assert watcher.stats.deleted == 1
    assert_no_repeats(event_log)
