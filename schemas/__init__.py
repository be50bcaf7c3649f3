"""OpenForge event schemas: pydantic models, versions, registry and JSON (de)serialization.

Every event is an immutable pydantic model with a schema name and major version. Kafka producers
call :func:`encode`, consumers call :func:`decode`; both go through the explicit registry
(:mod:`schemas.registry`), in which every built-in event is registered.

Importing the package imports none of its modules: each public name is loaded when first asked
for, so a process that needs one constant or one model (the verifier's ``openforge reward``, a
harness) does not build every model.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_WHERE: dict[str, str] = {
    "Logprobs": "schemas._arrays",
    "LossMask": "schemas._arrays",
    "PackedArray": "schemas._arrays",
    "RawBytes": "schemas._arrays",
    "TokenIds": "schemas._arrays",
    "EventBase": "schemas._base",
    "FrozenModel": "schemas._base",
    "UtcDatetime": "schemas._base",
    "Identifier": "schemas._common",
    "JsonObject": "schemas._common",
    "WeightVersionRange": "schemas._common",
    "DeadLetterErrorType": "schemas._errors",
    "DecodeError": "schemas._errors",
    "DuplicateSchemaError": "schemas._errors",
    "InvalidEventError": "schemas._errors",
    "MissingSchemaHeaderError": "schemas._errors",
    "RegistryError": "schemas._errors",
    "UndecodableEventError": "schemas._errors",
    "UnknownSchemaError": "schemas._errors",
    "UnregisteredEventError": "schemas._errors",
    "ApiProtocol": "schemas.call.v1",
    "CallChoice": "schemas.call.v1",
    "CallStatus": "schemas.call.v1",
    "CallTimings": "schemas.call.v1",
    "CallUsage": "schemas.call.v1",
    "ModelCallV1": "schemas.call.v1",
    "NormalizedRequest": "schemas.call.v1",
    "PromptPrefix": "schemas.call.v1",
    "CheckpointAppliedV1": "schemas.checkpoint.v1",
    "CheckpointV1": "schemas.checkpoint.v1",
    "LearnerProgressV1": "schemas.checkpoint.v1",
    "TopicOffset": "schemas.checkpoint.v1",
    "DeadLetterV1": "schemas.deadletter.v1",
    "event_json_schema": "schemas.export",
    "json_schemas": "schemas.export",
    "schema_file_name": "schemas.export",
    "DriftReason": "schemas.drift",
    "FailureReason": "schemas.failures",
    "LearnerStepV1": "schemas.learner_step.v1",
    "StepDrop": "schemas.learner_step.v1",
    "StepTrajectory": "schemas.learner_step.v1",
    "CONTENT_TYPE_HEADER": "schemas.registry",
    "EventRegistry": "schemas.registry",
    "Headers": "schemas.registry",
    "JSON_CONTENT_TYPE": "schemas.registry",
    "SCHEMA_HEADER": "schemas.registry",
    "VERSION_HEADER": "schemas.registry",
    "all_events": "schemas.registry",
    "decode": "schemas.registry",
    "default_registry": "schemas.registry",
    "encode": "schemas.registry",
    "register": "schemas.registry",
    "resolve": "schemas.registry",
    "RewardV1": "schemas.reward.v1",
    "Backend": "schemas.rollout.v1",
    "RolloutEventV1": "schemas.rollout.v1",
    "RolloutPhase": "schemas.rollout.v1",
    "RolloutReason": "schemas.rollout.v1",
    "ContainerLaunch": "schemas.task.v1",
    "HarnessSpec": "schemas.task.v1",
    "LocalLaunch": "schemas.task.v1",
    "Resources": "schemas.task.v1",
    "TaskV1": "schemas.task.v1",
    "VerifierSpec": "schemas.task.v1",
    "FinalizeReason": "schemas.trajectory.v1",
    "MergeBreakRecord": "schemas.trajectory.v1",
    "MergeStats": "schemas.trajectory.v1",
    "OriginSpan": "schemas.trajectory.v1",
    "TokenOrigin": "schemas.trajectory.v1",
    "ToolErrorRecord": "schemas.trajectory.v1",
    "ToolErrorRule": "schemas.trajectory.v1",
    "ToolUse": "schemas.trajectory.v1",
    "TrajectorySample": "schemas.trajectory.v1",
    "TrajectoryV1": "schemas.trajectory.v1",
}
"""The module that defines each public name."""

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'schemas' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # asked once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_WHERE})


if TYPE_CHECKING:  # the same names, for type checkers
    from schemas._arrays import Logprobs as Logprobs
    from schemas._arrays import LossMask as LossMask
    from schemas._arrays import PackedArray as PackedArray
    from schemas._arrays import RawBytes as RawBytes
    from schemas._arrays import TokenIds as TokenIds
    from schemas._base import EventBase as EventBase
    from schemas._base import FrozenModel as FrozenModel
    from schemas._base import UtcDatetime as UtcDatetime
    from schemas._common import Identifier as Identifier
    from schemas._common import JsonObject as JsonObject
    from schemas._common import WeightVersionRange as WeightVersionRange
    from schemas._errors import DeadLetterErrorType as DeadLetterErrorType
    from schemas._errors import DecodeError as DecodeError
    from schemas._errors import DuplicateSchemaError as DuplicateSchemaError
    from schemas._errors import InvalidEventError as InvalidEventError
    from schemas._errors import MissingSchemaHeaderError as MissingSchemaHeaderError
    from schemas._errors import RegistryError as RegistryError
    from schemas._errors import UndecodableEventError as UndecodableEventError
    from schemas._errors import UnknownSchemaError as UnknownSchemaError
    from schemas._errors import UnregisteredEventError as UnregisteredEventError
    from schemas.call.v1 import ApiProtocol as ApiProtocol
    from schemas.call.v1 import CallChoice as CallChoice
    from schemas.call.v1 import CallStatus as CallStatus
    from schemas.call.v1 import CallTimings as CallTimings
    from schemas.call.v1 import CallUsage as CallUsage
    from schemas.call.v1 import ModelCallV1 as ModelCallV1
    from schemas.call.v1 import NormalizedRequest as NormalizedRequest
    from schemas.call.v1 import PromptPrefix as PromptPrefix
    from schemas.checkpoint.v1 import CheckpointAppliedV1 as CheckpointAppliedV1
    from schemas.checkpoint.v1 import CheckpointV1 as CheckpointV1
    from schemas.checkpoint.v1 import LearnerProgressV1 as LearnerProgressV1
    from schemas.checkpoint.v1 import TopicOffset as TopicOffset
    from schemas.deadletter.v1 import DeadLetterV1 as DeadLetterV1
    from schemas.drift import DriftReason as DriftReason
    from schemas.export import event_json_schema as event_json_schema
    from schemas.export import json_schemas as json_schemas
    from schemas.export import schema_file_name as schema_file_name
    from schemas.failures import FailureReason as FailureReason
    from schemas.learner_step.v1 import LearnerStepV1 as LearnerStepV1
    from schemas.learner_step.v1 import StepDrop as StepDrop
    from schemas.learner_step.v1 import StepTrajectory as StepTrajectory
    from schemas.registry import CONTENT_TYPE_HEADER as CONTENT_TYPE_HEADER
    from schemas.registry import JSON_CONTENT_TYPE as JSON_CONTENT_TYPE
    from schemas.registry import SCHEMA_HEADER as SCHEMA_HEADER
    from schemas.registry import VERSION_HEADER as VERSION_HEADER
    from schemas.registry import EventRegistry as EventRegistry
    from schemas.registry import Headers as Headers
    from schemas.registry import all_events as all_events
    from schemas.registry import decode as decode
    from schemas.registry import default_registry as default_registry
    from schemas.registry import encode as encode
    from schemas.registry import register as register
    from schemas.registry import resolve as resolve
    from schemas.reward.v1 import RewardV1 as RewardV1
    from schemas.rollout.v1 import Backend as Backend
    from schemas.rollout.v1 import RolloutEventV1 as RolloutEventV1
    from schemas.rollout.v1 import RolloutPhase as RolloutPhase
    from schemas.rollout.v1 import RolloutReason as RolloutReason
    from schemas.task.v1 import ContainerLaunch as ContainerLaunch
    from schemas.task.v1 import HarnessSpec as HarnessSpec
    from schemas.task.v1 import LocalLaunch as LocalLaunch
    from schemas.task.v1 import Resources as Resources
    from schemas.task.v1 import TaskV1 as TaskV1
    from schemas.task.v1 import VerifierSpec as VerifierSpec
    from schemas.trajectory.v1 import FinalizeReason as FinalizeReason
    from schemas.trajectory.v1 import MergeBreakRecord as MergeBreakRecord
    from schemas.trajectory.v1 import MergeStats as MergeStats
    from schemas.trajectory.v1 import OriginSpan as OriginSpan
    from schemas.trajectory.v1 import TokenOrigin as TokenOrigin
    from schemas.trajectory.v1 import ToolErrorRecord as ToolErrorRecord
    from schemas.trajectory.v1 import ToolErrorRule as ToolErrorRule
    from schemas.trajectory.v1 import ToolUse as ToolUse
    from schemas.trajectory.v1 import TrajectorySample as TrajectorySample
    from schemas.trajectory.v1 import TrajectoryV1 as TrajectoryV1
