"""How a rollout pod is labelled and annotated: the contract between launcher and pod watcher.

The Kubernetes backend (``consumers``) writes these names onto every rollout pod; the pod watcher
(``producers``) reads them back to fill lifecycle events and to remember what it already published.
The two packages never import each other, so the names live here, next to the event they feed.
No I/O.
"""

from __future__ import annotations

import hashlib
import re

__all__ = [
    "ANNOTATION_FINISHED_AT",
    "ANNOTATION_GROUP_INDEX",
    "ANNOTATION_GROUP_SIZE",
    "ANNOTATION_HARNESS",
    "ANNOTATION_PUBLISHED",
    "ANNOTATION_ROLLOUT_ID",
    "ANNOTATION_RUN_ID",
    "ANNOTATION_TASK_ID",
    "FINALIZER",
    "HARNESS_CONTAINER",
    "LABEL_MANAGED_BY",
    "LABEL_ROLLOUT",
    "LABEL_RUN",
    "LABEL_TASK",
    "MANAGED_BY",
    "MANAGED_SELECTOR",
    "VERIFIER_CONTAINER",
    "WORKSPACE_PATH",
    "label_value",
]

LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
"""Standard label; every rollout pod carries ``openforge`` here, so one selector finds them all."""
MANAGED_BY = "openforge"
"""Value of :data:`LABEL_MANAGED_BY` on rollout pods."""
MANAGED_SELECTOR = f"{LABEL_MANAGED_BY}={MANAGED_BY}"
"""Label selector of every rollout pod."""
LABEL_RUN = "openforge.dev/run"
"""The run id as a label value (see :func:`label_value`); absent when the task has no run."""
LABEL_TASK = "openforge.dev/task"
"""The task id as a label value (see :func:`label_value`)."""
LABEL_ROLLOUT = "openforge.dev/rollout"
"""The rollout id as a label value (see :func:`label_value`)."""

# Label values are limited to 63 characters of [A-Za-z0-9._-]; ids are not. The exact ids travel
# in annotations, which have no such limit, and the watcher reads those.
ANNOTATION_ROLLOUT_ID = "openforge.dev/rollout-id"
"""The exact rollout id."""
ANNOTATION_TASK_ID = "openforge.dev/task-id"
"""The exact task id."""
ANNOTATION_RUN_ID = "openforge.dev/run-id"
"""The exact run id, when the task has one."""
ANNOTATION_GROUP_INDEX = "openforge.dev/group-index"
"""The rollout's index in its task's group (decimal)."""
ANNOTATION_GROUP_SIZE = "openforge.dev/group-size"
"""The task's group size (decimal)."""
ANNOTATION_HARNESS = "openforge.dev/harness"
"""The harness name."""
ANNOTATION_PUBLISHED = "openforge.dev/published-phases"
"""Written by the pod watcher only: comma-separated lifecycle phases already acknowledged by
Kafka for this pod. It survives watcher restarts, re-lists and API-server restarts, which is
what keeps a phase from being published twice."""
ANNOTATION_FINISHED_AT = "openforge.dev/finished-at"
"""Written by the pod watcher with the terminal phase: when it published it (RFC 3339, UTC);
finished pods are deleted a configurable time after it."""

FINALIZER = "openforge.dev/lifecycle-published"
"""On every rollout pod from its creation; the pod watcher removes it once the rollout's terminal
event is on Kafka. A pod deleted while no watcher was watching (a watcher restart, an API-server
restart that forces a re-list) is then still there, marked for deletion, for the next list to see,
instead of vanishing without a terminal event."""

HARNESS_CONTAINER = "harness"
"""Name of the init container that runs the harness."""
VERIFIER_CONTAINER = "verifier"
"""Name of the main container that runs the verifier after the harness exited."""
WORKSPACE_PATH = "/workspace"
"""Where the shared emptyDir workspace is mounted in both containers (and their working dir)."""

_LABEL_OK = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9])?$")


def label_value(text: str) -> str:
    """Return ``text`` if it is a valid label value, else a stable, valid stand-in.

    The stand-in keeps a readable prefix and adds a hash of the whole id, so different ids never
    share a value and the same id always maps to the same one (selectors stay usable).
    """
    if _LABEL_OK.match(text):
        return text
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]
    prefix = re.sub(r"[^A-Za-z0-9_.-]", "-", text)[:48].strip("-_.")
    return f"{prefix}-{digest}" if prefix else digest


def scheduled_event_id(rollout_id: str) -> str:
    """Event id of a rollout's ``scheduled`` event.

    The launcher publishes ``scheduled`` before it creates the pod and the pod watcher derives it
    again from the pod; one id for both makes the second a duplicate that consumers drop.
    """
    return f"{rollout_id}.scheduled"
